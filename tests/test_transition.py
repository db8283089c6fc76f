"""The migration's transition: dual write of legacy turns, and reads of unmigrated conversations."""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import bson
import pytest
from pymongo.errors import AutoReconnect

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    LegacyTurns,
    NotFound,
    SteeringInbox,
    StorageFailure,
    StorageUnavailable,
    TurnRules,
    VersionMismatch,
)
from agent_store.core import MAX_JSON_VALUES, AgentMessage, utc_now
from agent_store.legacy import (
    CLAIMED_FROM,
    COPY_PIECES,
    LEGACY_TURNS,
    MIGRATION_STATE,
    MIXED_USER_IDS,
    SESSION_HITL,
    convert,
    copy_record_id,
    derived_user_id,
    is_pending_prompt,
    legacy_turn_id,
    parse_turns,
    with_session_prompts,
)
from agent_store.store import (
    BLOB_BUCKET,
    CONVERSATIONS,
    MAX_MESSAGE_BYTES,
    MESSAGES,
    TRUNCATION_MARK,
    is_derived_id,
)
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_legacy_turns
from migrations.lease import STATE, STATE_ID
from migrations.transcript import differences, from_legacy, from_messages
from tests.conftest import COUNTED, Backend
from tests.test_logger import log_example
from tests.turn_shapes import NATIVE_FORM, TURN_SHAPES


def visible(messages: list[AgentMessage]) -> list[tuple[object, ...]]:
    return [
        (m.role, m.content, m.tool_calls, m.tool_call_id, m.hitl_action, m.error, m.upload)
        for m in messages
    ]


async def test_dual_write_keeps_each_turn_as_a_legacy_turn_that_converts_back(
    backend: Backend,
) -> None:
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    await log_example(logger)
    await log_example(logger)  # retried turns rewrite the same legacy documents

    legacy = await backend.db[LEGACY_TURNS].find().to_list(None)
    transcript = await ConversationStore(backend.db, legacy=LegacyTurns(backend.db)).transcript(
        EXAMPLE_CONVERSATION_ID
    )

    assert len(legacy) == 4
    assert all(doc["dual_write"] for doc in legacy)
    assert {doc["user_id"] for doc in legacy} == {EXAMPLE_USER_ID}
    converted = convert(legacy)
    assert converted.problems == []
    assert visible(converted.messages) == visible(transcript)
    assert [m.created_at for m in converted.messages if m.role == "user"] == [
        m.created_at for m in transcript if m.role == "user"
    ]


@pytest.mark.parametrize(
    "text",
    [
        "[" * 80 + "1,2" + "]" * 80,
        "[" * 3_000 + "1,2" + "]" * 3_000,
        "[" * 20_000 + "1,2" + "]" * 20_000,
        "[" + ",".join(["[]"] * MAX_JSON_VALUES) + "]",
    ],
    ids=["past-mongodbs-depth", "past-pythons-recursion", "past-pythons-parser", "wide"],
)
async def test_dual_write_keeps_json_past_the_bounds_the_store_walks_as_its_text(
    backend: Backend, text: str
) -> None:
    """A call's arguments and a result the turn stores as written (JSON nested deeper than
    `MAX_PARAMS_DEPTH`, or of more values than `MAX_JSON_VALUES`) are copied as their text,
    never parsed into the legacy turn (nested 3,000 deep the copy failed the turn with a
    RecursionError; 100 levels are more than MongoDB keeps): the turn is stored, its copy
    converts back to it."""
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}
    turn = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": text},
    ]
    await logger.log_messages("conv-deep", turn, user_id="user-1", turn_id="t0")

    (copy,) = await backend.db[LEGACY_TURNS].find().to_list(None)
    transcript = await ConversationStore(backend.db).transcript("conv-deep")
    assert visible(convert([copy]).messages) == visible(transcript)


async def test_a_conversation_with_legacy_turns_kept_beside_it_can_be_renamed(
    backend: Backend,
) -> None:
    """Legacy turns are looked for only when the conversation is missing, as for a turn."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    await log_example(logger)

    renamed = await logger.upsert_conversation(EXAMPLE_CONVERSATION_ID, name="Trip")

    assert renamed.name == "Trip"


async def migrated(backend: Backend, turns: list[dict[str, Any]]) -> str:
    """Legacy turns as the migration leaves them: converted, their conversation document
    and messages stored, the turns in the legacy collection; the id they are stored under."""
    conversion = convert(turns)
    assert conversion.conversation is not None
    await backend.db[CONVERSATIONS].insert_one(conversion.conversation.model_dump(by_alias=True))
    await backend.db[MESSAGES].insert_many(
        [m.model_dump(by_alias=True) for m in conversion.messages]
    )
    await backend.db[LEGACY_TURNS].insert_many(turns)
    return conversion.conversation_id


@pytest.mark.parametrize(
    ("legacy_id", "named"),
    [("conv 42/é", "conv 42/é"), (None, "legacy-turn-t-1")],
    ids=["a legacy id that is not an identifier", "a turn naming no conversation"],
)
async def test_dual_write_names_a_conversation_as_its_legacy_turns_name_it(
    backend: Backend, legacy_id: str | None, named: str
) -> None:
    """After a rollback the old service reads a conversation by the id its legacy turns name:
    one stored under a derived id is dual-written under the legacy id it stands for. A turn
    naming none gives no id to name: its live turns go under the derived one, the id the
    new service served it by, which a second attempt files them under again."""
    turn = {"_id": "t-1", "conversation_id": legacy_id, "user_id": "u-1",
            "created_at": utc_now(), "user_message": "«LEGACY»"}  # fmt: skip
    stored_id = await migrated(backend, [turn])
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    for _ in range(2):  # a retry rewrites the same legacy turn
        await logger.log_messages(stored_id, [{"role": "user", "content": "«LIVE»"}],
                                  user_id="u-1", turn_id="native-1")  # fmt: skip

    copies = await backend.db[LEGACY_TURNS].find({"dual_write": True}).to_list(None)
    converted = convert(await backend.db[LEGACY_TURNS].find().to_list(None))

    assert [c["conversation_id"] for c in copies] == [named]
    assert converted.conversation_id == stored_id
    assert [m.content for m in converted.messages] == ["«LEGACY»", "«LIVE»"]


ALICE_LEGACY = "alice+work@example.com"
"""A legacy user id that is no identifier: the migration stores its owner as derived."""


async def derived_owners_conversation(backend: Backend, *, recorded: bool = True) -> str:
    """Alice's legacy conversation, migrated owned by the user derived from her legacy id;
    without the id recorded (`recorded=False`) as a run before it was recorded left it."""
    turn = {"_id": "t-1", "conversation_id": "c-b", "user_id": ALICE_LEGACY,
            "created_at": utc_now(), "user_message": "«LEGACY»"}  # fmt: skip
    cid = await migrated(backend, [turn])
    if not recorded:
        await backend.db[CONVERSATIONS].update_one({"_id": cid}, {"$unset": {"legacy_user_id": 1}})
    return cid


async def test_dual_write_names_a_derived_user_by_the_legacy_id_that_derives_it(
    backend: Backend,
) -> None:
    """After a rollback the old service takes the last user a conversation's turns name for
    its owner: a live turn of the user the migration derived is copied naming the legacy id
    the conversation's other turns name (`legacy_user_id`, which the migration records), and
    a second attempt reads the copy as the same user's turn."""
    cid = await derived_owners_conversation(backend)
    owner = derived_user_id(ALICE_LEGACY)
    logger, _ = wired(backend, dual_write=True)
    await logger.log_messages(cid, [{"role": "user", "content": "«LIVE»"}],
                              user_id=owner, turn_id="live-1")  # fmt: skip

    stored = await backend.db[CONVERSATIONS].find_one({"_id": cid})
    legacy = await backend.db[LEGACY_TURNS].find().to_list(None)
    again = convert(legacy)

    assert {t["user_id"] for t in legacy} == {ALICE_LEGACY}
    assert stored is not None
    assert stored["legacy_user_id"] == ALICE_LEGACY
    assert again.owner == owner
    assert MIXED_USER_IDS not in {p.kind for p in again.problems}
    assert [m.content for m in again.messages] == ["«LEGACY»", "«LIVE»"]


async def test_a_fork_of_a_derived_owners_conversation_is_copied_naming_the_legacy_id(
    backend: Backend,
) -> None:
    """A fork is its source's owner's, and its copies are legacy turns of the source's: the
    fork records the legacy id its source's owner was derived from (`legacy_user_id`), so
    its copies and its own live turns name that legacy id, as the source's do."""
    cid = await derived_owners_conversation(backend)
    owner = derived_user_id(ALICE_LEGACY)
    logger, _ = wired(backend, dual_write=True)
    await logger.log_messages(cid, [{"role": "user", "content": "«LIVE»"}],
                              user_id=owner, turn_id="live-1")  # fmt: skip
    await logger.fork(cid, 1, "f-1", user_id=owner)
    await logger.log_messages("f-1", [{"role": "user", "content": "«FORKED»"}],
                              user_id=owner, turn_id="live-2")  # fmt: skip

    fork = await backend.db[CONVERSATIONS].find_one({"_id": "f-1"})
    copies = await backend.db[LEGACY_TURNS].find({"conversation_id": "f-1"}).to_list(None)
    assert fork is not None
    assert fork["legacy_user_id"] == ALICE_LEGACY
    assert len(copies) >= 2
    assert {c["user_id"] for c in copies} == {ALICE_LEGACY}


async def test_a_derived_users_copies_follow_a_claim_and_an_erasure(backend: Backend) -> None:
    """A claim moves the copies naming the legacy id to the new user, and the conversation
    no longer records it: the new user's turns are copied naming them. Erasing the derived
    user takes the conversation, the legacy id it records, and every copy naming it."""
    cid = await derived_owners_conversation(backend)
    owner = derived_user_id(ALICE_LEGACY)
    logger, store = wired(backend, dual_write=True)
    await logger.log_messages(cid, [{"role": "user", "content": "a"}], user_id=owner,
                              turn_id="live-1")  # fmt: skip
    await store.claim(owner, "user-alice")
    await logger.log_messages(cid, [{"role": "user", "content": "b"}], user_id="user-alice",
                              turn_id="live-2")  # fmt: skip

    stored = await backend.db[CONVERSATIONS].find_one({"_id": cid})
    legacy = await backend.db[LEGACY_TURNS].find().to_list(None)
    assert stored is not None
    assert stored.get("legacy_user_id") is None
    assert {t["user_id"] for t in legacy} == {"user-alice"}

    cid2 = "c-2"
    await backend.db[LEGACY_TURNS].delete_many({})
    await backend.db[CONVERSATIONS].delete_many({})
    turn = {"_id": "t-2", "conversation_id": cid2, "user_id": ALICE_LEGACY,
            "created_at": utc_now(), "user_message": "x"}  # fmt: skip
    await migrated(backend, [turn])
    await logger.log_messages(cid2, [{"role": "user", "content": "y"}], user_id=owner,
                              turn_id="live-3")  # fmt: skip
    await store.erase_user(owner)

    assert await backend.db[CONVERSATIONS].count_documents({}) == 0
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


async def test_a_conversation_migrated_before_the_legacy_user_id_was_recorded_copies_the_derived_id(
    backend: Backend,
) -> None:
    """No `legacy_user_id` (a run before it was recorded): the copy names the derived user, as
    it did; the dual write guesses no legacy id. A user id that is not derived is copied as
    it is."""
    cid = await derived_owners_conversation(backend, recorded=False)
    owner = derived_user_id(ALICE_LEGACY)
    logger, _ = wired(backend, dual_write=True)
    await logger.log_messages(cid, [{"role": "user", "content": "«LIVE»"}],
                              user_id=owner, turn_id="live-1")  # fmt: skip

    [copy] = await backend.db[LEGACY_TURNS].find({"dual_write": True}).to_list(None)
    assert copy["user_id"] == owner


async def test_dual_write_is_off_unless_asked_for(backend: Backend) -> None:
    await log_example(AgentMessageLogger(backend.db))
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


@pytest.mark.wire
@pytest.mark.parametrize("legacy_id", [None, "conv 42/é"],
                         ids=["logged live", "migrated under a derived id"])  # fmt: skip
async def test_dual_write_costs_four_more_round_trips(
    wire_backend: Backend, legacy_id: str | None
) -> None:
    """The record of its copy as intended (`COPY_RECORD`), the legacy turn's upsert naming
    it, the record confirmed, then the lookup that takes the copy back if the conversation
    was deleted meanwhile; naming a conversation by its legacy id costs no read."""
    assert wire_backend.commands is not None
    cid = "dual"
    if legacy_id is not None:
        old = {"_id": "t-0", "conversation_id": legacy_id, "created_at": utc_now(),
               "user_message": "old"}  # fmt: skip
        cid = await migrated(wire_backend, [old])
    logger = AgentMessageLogger(
        wire_backend.db, observers=[LegacyTurns(wire_backend.db, dual_write=True)], rules=COUNTED
    )
    wire_backend.commands.clear()
    await logger.log_messages(cid, [{"role": "user", "content": "hi"}], turn_id="t1")
    names = ["findAndModify", "insert", "update", "update", "update", "find"]
    assert wire_backend.commands.names == names


async def test_reads_of_an_unmigrated_conversation_fall_back_to_its_legacy_turns(
    backend: Backend,
) -> None:
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await backend.db[SESSION_HITL].insert_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
         "action": "confirm_booking"}
    )  # fmt: skip
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    expected = convert(example_legacy_turns())

    transcript = await store.transcript(EXAMPLE_CONVERSATION_ID)
    conversation = await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    first = await store.messages_page(EXAMPLE_CONVERSATION_ID, limit=5)
    second = await store.messages_page(EXAMPLE_CONVERSATION_ID, limit=10, after=first.last_id)
    newest = await store.messages_page(EXAMPLE_CONVERSATION_ID, limit=1, order="desc")

    assert transcript == expected.messages
    assert conversation.turn_count == 4
    assert await store.turn_count(EXAMPLE_CONVERSATION_ID) == 4
    pending = await store.pending_hitl(EXAMPLE_CONVERSATION_ID)
    assert pending is not None
    assert pending.request_id == "req-booking-1"
    assert first.data + second.data == transcript
    assert (first.has_more, second.has_more) == (True, False)
    assert newest.data == [transcript[-1]]
    with pytest.raises(NotFound):
        await store.transcript(EXAMPLE_CONVERSATION_ID, user_id="someone-else")
    with pytest.raises(NotFound):
        await ConversationStore(
            backend.db, legacy=LegacyTurns(backend.db, read_fallback=False)
        ).transcript(EXAMPLE_CONVERSATION_ID)


async def test_the_read_fallback_shows_no_users_prompt_as_a_conversation_no_user_owns(
    backend: Backend,
) -> None:
    """Before the migration as after it (`owners_prompt`): a prompt naming a user is never
    the pending prompt of a conversation whose turns name no user; one naming no user is."""
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "t-1", "conversation_id": "c-n", "created_at": utc_now(),
         "user_message": "pay my rent", "response_parts": [{"type": "text", "content": "ok"}]}
    )  # fmt: skip
    asked = {"_id": "p-1", "conversation_id": "c-n", "request_id": "req-1", "action": "pay",
             "params": {"iban": "A-SECRET-IBAN"}, "status": "pending"}  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(asked | {"user_id": "u-a"})
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    conversation = await store.get_conversation("c-n")

    assert conversation.user_id is None
    assert conversation.pending_hitl is None
    assert await store.pending_hitl("c-n") is None
    await backend.db[SESSION_HITL].replace_one({"_id": "p-1"}, asked)
    nobodys = await store.pending_hitl("c-n")
    assert nobodys is not None
    assert nobodys.request_id == "req-1"


async def test_the_read_fallbacks_pending_prompt_holding_values_json_cannot_encode_reads_as_json(
    backend: Backend,
) -> None:
    """A `session_hitl` prompt whose params hold an ObjectId, bytes or a Decimal128 gives
    the conversation a pending prompt the service can write as JSON: the params its message
    raised it with (MIGRATION.md), not those values."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await backend.db[SESSION_HITL].insert_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
         "action": "confirm_booking",
         "params": {"id": bson.ObjectId(), "raw": b"\x00\xff", "price": bson.Decimal128("35")}}
    )  # fmt: skip
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    conversation = await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)

    assert conversation.pending_hitl is not None
    assert conversation.pending_hitl.params == {"train": "TGV 6601", "price_eur": 35}
    conversation.model_dump_json()


async def test_answering_an_unmigrated_conversations_prompt_is_refused_as_not_migrated_yet(
    backend: Backend,
) -> None:
    """The read fallback shows the prompt of a conversation not migrated yet as pending; an
    answer to it is refused as every write to a conversation that exists only as legacy
    turns is (the logger's words), not as an answer read before the prompt was asked again
    (it named no calls), and nothing is written."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await backend.db[SESSION_HITL].insert_one(
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
         "action": "confirm_booking", "status": "pending", "user_id": EXAMPLE_USER_ID}
    )  # fmt: skip
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db, dual_write=True))
    pending = await store.pending_hitl(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    assert pending is not None

    with pytest.raises(Conflict) as refused:
        await store.resolve_hitl(EXAMPLE_CONVERSATION_ID, "req-booking-1", user_id=EXAMPLE_USER_ID)

    assert str(refused.value) == (
        f"conversation {EXAMPLE_CONVERSATION_ID!r} exists as legacy turns not migrated yet; it "
        "can be answered once `python -m migrations run` has migrated it"
    )
    assert await backend.db[CONVERSATIONS].count_documents({}) == 0
    prompt = await backend.db[SESSION_HITL].find_one({"request_id": "req-booking-1"})
    assert prompt is not None
    assert prompt["status"] == "pending"
    with pytest.raises(NotFound):
        await store.resolve_hitl(EXAMPLE_CONVERSATION_ID, "req-booking-1", user_id="someone-else")


async def test_an_unmigrated_conversation_cannot_be_renamed_yet(backend: Backend) -> None:
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    with pytest.raises(
        Conflict, match="exists as legacy turns not migrated yet; it can be renamed once"
    ):
        await store.rename(EXAMPLE_CONVERSATION_ID, "New name")
    with pytest.raises(NotFound):
        await store.delete("never-existed")
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 4


async def test_an_unmigrated_conversation_cannot_be_forked_yet(backend: Backend) -> None:
    """A fork of a conversation that exists only as legacy turns is refused as every write
    to it is (409, to be made once the migration has run), to its owner and to a service,
    never NotFound for what its owner reads; another user's token still finds nothing. No
    fork is created."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    legacy = LegacyTurns(backend.db)
    logger = AgentMessageLogger(backend.db, legacy=legacy)
    not_yet = (
        f"conversation {EXAMPLE_CONVERSATION_ID!r} exists as legacy turns not migrated yet; it "
        "can be forked once `python -m migrations run` has migrated it"
    )

    for user_id, owner_only in [(EXAMPLE_USER_ID, True), (None, False)]:
        with pytest.raises(Conflict) as refused:
            await logger.fork(
                EXAMPLE_CONVERSATION_ID, 0, "c-fork", user_id=user_id, owner_only=owner_only
            )
        assert str(refused.value) == not_yet
    with pytest.raises(NotFound):
        await logger.fork(EXAMPLE_CONVERSATION_ID, 0, "c-fork", user_id="someone-else",
                          owner_only=True)  # fmt: skip

    assert await backend.db[CONVERSATIONS].count_documents({}) == 0
    assert await backend.db[MESSAGES].count_documents({}) == 0


async def test_deleting_an_unmigrated_conversation_removes_its_legacy_turns(
    backend: Backend,
) -> None:
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    deleted = await store.delete(EXAMPLE_CONVERSATION_ID)
    assert (deleted.conversations, deleted.messages, deleted.legacy_turns) == (0, 0, 4)
    with pytest.raises(NotFound):
        await store.transcript(EXAMPLE_CONVERSATION_ID)


async def test_deleting_an_unmigrated_conversation_naming_its_version_checks_it(
    backend: Backend,
) -> None:
    """A conversation read through the fallback has a version too (from its `created_at`,
    it has no epoch): a delete naming another leaves its legacy turns; one naming its own
    deletes them."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    version = (await store.get_conversation(EXAMPLE_CONVERSATION_ID)).version

    with pytest.raises(VersionMismatch):
        await store.delete(EXAMPLE_CONVERSATION_ID, version="0" * 32)
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 4
    deleted = await store.delete(EXAMPLE_CONVERSATION_ID, version=version)
    assert deleted.legacy_turns == 4


UNDATED = {
    "a text _id, no created_at": {"_id": "lt-1"},
    "an unreadable created_at": {"_id": "lt-1", "created_at": "sometime last spring"},
    "an all-zero ObjectId, created_at 0": {"_id": bson.ObjectId("0" * 24), "created_at": 0},
}
"""Legacy turns without a readable time: neither a `created_at` the store takes nor an
ObjectId's time."""


def undated_turn(shape: str) -> dict[str, Any]:
    return {"conversation_id": "c-undated", "user_id": "u-1", "user_message": "old",
            "response_parts": [{"type": "text", "content": "a"}], **UNDATED[shape]}  # fmt: skip


async def served_times(store: ConversationStore) -> tuple[str, set[datetime]]:
    """The version of the conversation of `undated_turn`, and every time its reads serve: the
    conversation's, the transcript's, a page's."""
    conversation = await store.get_conversation("c-undated", user_id="u-1")
    transcript = await store.transcript("c-undated", user_id="u-1")
    page = await store.messages_page("c-undated", user_id="u-1", limit=1, order="desc")
    times = {conversation.created_at, conversation.updated_at}
    return conversation.version, times | {m.created_at for m in transcript + page.data}


@pytest.mark.parametrize("shape", list(UNDATED))
async def test_a_legacy_conversation_without_a_readable_time_is_served_the_same_on_every_read(
    backend: Backend, shape: str
) -> None:
    """No turn of it has a readable time, and no migration has recorded its first start: every
    read serves the Unix epoch, the store's "unknown", never the time of the read; so its
    version (the `ETag`) is the same on every read, and a delete naming it deletes it."""
    await backend.db[LEGACY_TURNS].insert_one(undated_turn(shape))
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    version, times = await served_times(store)
    await asyncio.sleep(0.01)

    assert await served_times(store) == (version, times)
    assert times == {datetime(1970, 1, 1, tzinfo=UTC)}
    deleted = await store.delete("c-undated", user_id="u-1", version=version)
    assert deleted.legacy_turns == 1
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


async def test_a_legacy_conversation_without_a_readable_time_is_served_the_migrations_time(
    backend: Backend,
) -> None:
    """Once a run recorded its first start (the time it gives such a conversation), the read
    fallback serves that time, read and never written: the conversation keeps its times and
    its version when the run moves it."""
    given = datetime(2025, 6, 1, 8, 30, 0, 123000, tzinfo=UTC)
    await backend.db[STATE].insert_one({"_id": STATE_ID, "undated_at": given})
    turn = undated_turn("a text _id, no created_at")
    await backend.db[LEGACY_TURNS].insert_one(turn)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    migrated = convert([turn], undated_at=given).conversation
    assert migrated is not None

    version, times = await served_times(store)

    assert (version, times) == (migrated.version, {given})
    assert await served_times(store) == (version, times)
    assert await backend.db[STATE].find_one({"_id": STATE_ID}, {"_id": 0}) == {"undated_at": given}
    assert (await store.delete("c-undated", user_id="u-1", version=version)).legacy_turns == 1


async def test_a_deleted_migrated_conversation_does_not_come_back_from_its_legacy_turns(
    backend: Backend,
) -> None:
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await log_example(AgentMessageLogger(backend.db))
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    deleted = await store.delete(EXAMPLE_CONVERSATION_ID)
    assert (deleted.conversations, deleted.messages, deleted.legacy_turns) == (1, 12, 4)
    with pytest.raises(NotFound):
        await store.get_conversation(EXAMPLE_CONVERSATION_ID)


async def test_erase_and_claim_reach_the_legacy_turns(backend: Backend) -> None:
    turns = example_legacy_turns()
    owner = turns[0]["user_id"]
    turns[1]["user_id"] = None  # real data: some turns carry no owner
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    claimed = await store.claim(owner, "user-claimed")
    assert claimed.legacy_turns == 3
    erased = await store.erase_user("user-claimed")
    assert erased.legacy_turns == 4
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


async def test_a_legacy_turn_naming_the_user_a_claim_moved_its_conversation_from_is_the_claimers(
    backend: Backend,
) -> None:
    """The old service, which knows of no claim, logs a turn naming the user id a claim moved
    the conversation away from: the read fallback serves it to the claimer, with the rest of
    the conversation, and to the old id nothing; the claimer's erasure takes it."""
    turns = example_legacy_turns()
    owner = turns[0]["user_id"]
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(owner, "user-claimed")
    late = {**turns[0], "_id": "t-late", "created_at": "2030-01-01T00:00:00Z"}
    await backend.db[LEGACY_TURNS].insert_one(late | {"user_message": "LATE"})

    served = await store.transcript(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")

    assert [m.content for m in served if m.role == "user"][-1] == "LATE"
    with pytest.raises(NotFound):
        await store.transcript(EXAMPLE_CONVERSATION_ID, user_id=owner)
    erased = await store.erase_user("user-claimed")
    assert erased.legacy_turns == len(turns) + 1
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


@pytest.mark.parametrize("by", ["delete", "erasure"])
async def test_a_late_turn_naming_the_user_a_claim_moved_its_conversation_from_is_the_claimers(
    backend: Backend, by: str
) -> None:
    """A late turn the old service logs in `agent_conversations` (no run moved it aside yet)
    naming the user id a claim moved its conversation away from is judged as the legacy
    collection's turns are (`turn_users`): the claimer's delete and erasure take it, so no
    later run brings the deleted conversation back under the old id."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await log_example(AgentMessageLogger(backend.db))
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(EXAMPLE_USER_ID, "user-claimed")
    late = {**example_legacy_turns()[0], "_id": "t-late", "created_at": "2030-01-01T00:00:00Z"}
    await backend.db[CONVERSATIONS].insert_one(late)

    if by == "delete":
        await store.delete(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")
    else:
        await store.erase_user("user-claimed")

    assert await backend.db[CONVERSATIONS].find_one({"_id": "t-late"}) is None
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


async def test_erasing_the_user_a_claim_moved_a_conversation_from_leaves_its_claimed_turns(
    backend: Backend,
) -> None:
    """A turn of a claimed conversation naming the pre-claim user id is the claimer's
    (`turn_users`) to the erasure too, in the legacy collection and late in
    `agent_conversations` alike: the erasure of the old id leaves them, and the read
    fallback still serves the claimer the one in the legacy collection."""
    turns = example_legacy_turns()
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(EXAMPLE_USER_ID, "user-claimed")
    late = {**turns[0], "_id": "t-late", "created_at": "2030-01-01T00:00:00Z"}
    await backend.db[LEGACY_TURNS].insert_one(late | {"user_message": "LATE"})
    later = late | {"_id": "t-later", "created_at": "2030-01-02T00:00:00Z"}
    await backend.db[CONVERSATIONS].insert_one(later)

    erased = await store.erase_user(EXAMPLE_USER_ID)

    assert erased.legacy_turns == 0
    assert await backend.db[CONVERSATIONS].find_one({"_id": "t-later"}) == later
    served = await store.transcript(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")
    assert [m.content for m in served if m.role == "user"][-1] == "LATE"


@pytest.mark.parametrize("where", [LEGACY_TURNS, CONVERSATIONS])
async def test_a_second_claim_of_the_user_a_claim_moved_a_conversation_from_leaves_its_turns(
    backend: Backend, where: str
) -> None:
    """A turn of a claimed conversation naming the pre-claim user id is the claimer's
    (`turn_users`) to a claim too: a second claim of the old id, to another user, leaves it,
    in the legacy collection and late in `agent_conversations` alike, as the erasure of the
    old id does, and moves only what is still the old id's (a conversation the old service
    started under it after the first claim). The first claimer is still served the turn,
    the second claimer nothing of her conversation."""
    turns = example_legacy_turns()
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(EXAMPLE_USER_ID, "user-claimed")
    late = {**turns[0], "_id": "t-late", "created_at": "2030-01-01T00:00:00Z"}
    late |= {"user_message": "LATE"}
    await backend.db[where].insert_one(late)
    started = {**late, "_id": "t-new", "conversation_id": "c-new", "user_message": "NEW"}
    await backend.db[LEGACY_TURNS].insert_one(started)

    claimed = await store.claim(EXAMPLE_USER_ID, "user-other")

    assert claimed.legacy_turns == 1
    assert await backend.db[where].find_one({"_id": "t-late"}) == late
    with pytest.raises(NotFound):
        await store.transcript(EXAMPLE_CONVERSATION_ID, user_id="user-other")
    served = await store.transcript(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")
    if where == LEGACY_TURNS:
        assert [m.content for m in served if m.role == "user"][-1] == "LATE"
    new = await store.transcript("c-new", user_id="user-other")
    assert [m.content for m in new if m.role == "user"] == ["NEW"]


def _mixed_turn(turn_id: str, user_id: str, minutes: int, text: str) -> dict[str, Any]:
    """A legacy turn of the mixed conversation `c-mixed` naming `user_id`, asking `text`."""
    at = datetime(2026, 3, 2, 9, 0, tzinfo=UTC) + timedelta(minutes=minutes)
    reply = [{"type": "text", "content": f"{text} a"}]
    return {
        "_id": turn_id,
        "conversation_id": "c-mixed",
        "user_id": user_id,
        "created_at": at,
        "user_message": f"{text} q",
        "response_parts": reply,
    }


@pytest.mark.parametrize("dan_first", [False, True])
@pytest.mark.parametrize(
    ("claims", "ann", "dan"),
    [
        ((("a", "b"), ("b", "a"), ("d", "b")), "a", "b"),
        ((("a", "b"), ("d", "a")), "b", "a"),
    ],
    ids=["undone", "swapped"],
)
async def test_a_turn_a_claim_moved_is_its_claimers_whatever_other_claims_of_its_conversation(
    backend: Backend,
    claims: tuple[tuple[str, str], ...],
    ann: str,
    dan: str,
    dan_first: bool,
) -> None:
    """A mixed conversation holds Ann's turn (`a`) and Dan's (`d`); claims move them, one user
    id both moved from and moved to (`a` claimed to `b` by mistake, undone, then `d` to `b`;
    or `a` to `b`, then `d` to `a`). A turn a claim moved names the user the claim wrote: the
    read fallback serves the owner (who names the last turn) her own words alone, the other
    nothing, and Ann's erasure leaves Dan's turn (was: read through another turn's claim, so
    Ann was served Dan's words and her erasure took his turn)."""
    turns = [_mixed_turn("t-ann", "a", int(dan_first), "ANN")]
    turns.append(_mixed_turn("t-dan", "d", int(not dan_first), "DAN"))
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    for from_user_id, to_user_id in claims:
        await store.claim(from_user_id, to_user_id)

    (owner, words), other = ((ann, "ANN q"), dan) if dan_first else ((dan, "DAN q"), ann)
    served = await store.transcript("c-mixed", user_id=owner)
    assert [m.content for m in served if m.role == "user"] == [words]
    with pytest.raises(NotFound):
        await store.transcript("c-mixed", user_id=other)
    erased = await store.erase_user(ann)
    assert erased.legacy_turns == 1
    assert [d["_id"] for d in await backend.db[LEGACY_TURNS].find({}).to_list(None)] == ["t-dan"]


_RESAVE_STORIES = pytest.mark.parametrize(
    ("claims", "resaved", "ann", "dan"),
    [((("a", "b"), ("d", "a")), "t-ann", "b", "a"), ((("d", "b"), ("a", "d")), "t-dan", "d", "b")],
    ids=["swapped", "dtob"],
)
"""A mixed conversation of Ann's turn (`a`) and Dan's (`d`), claims moving one user id both
away and to (`a` to `b`, then `d` to `a`; or `d` to `b`, then `a` to `d`), the turn the old
service saves again after them, and Ann's and Dan's user ids then."""


async def _resaved_after_claims(
    backend: Backend, claims: tuple[tuple[str, str], ...], resaved: str
) -> ConversationStore:
    """The mixed conversation `c-mixed` late in `agent_conversations` (no run moved it aside
    yet), the `claims` made, then the moved turn `resaved` saved again by the old service
    from its cache: an upsert by `_id` naming the user id it knew, no `claimed_from`."""
    turns = [_mixed_turn("t-ann", "a", 0, "ANN"), _mixed_turn("t-dan", "d", 1, "DAN")]
    await backend.db[CONVERSATIONS].insert_many([dict(t) for t in turns])
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    for from_user_id, to_user_id in claims:
        await store.claim(from_user_id, to_user_id)
    cached = next(t for t in turns if t["_id"] == resaved)
    await backend.db[CONVERSATIONS].replace_one({"_id": resaved}, cached, upsert=True)
    return store


@_RESAVE_STORIES
@pytest.mark.parametrize("erased", ["ann", "dan"])
async def test_a_moved_turn_the_old_service_saves_again_in_place_stays_its_claimers_to_an_erasure(
    backend: Backend,
    claims: tuple[tuple[str, str], ...],
    resaved: str,
    ann: str,
    dan: str,
    erased: str,
) -> None:
    """A claim records each turn it moves where the old service never writes (`CLAIM_RECORD`):
    the old service re-saving the moved turn in place, naming the user id it knew and no
    `claimed_from`, leaves it the claimer's, so each person's erasure takes her own turn and
    leaves the other's (was: the turn was the claim's only record, so it read through the
    other claim as the other person's: Ann's erasure took Dan's turn, or left her own)."""
    store = await _resaved_after_claims(backend, claims, resaved)
    user_id = ann if erased == "ann" else dan

    erasure = await store.erase_user(user_id)

    assert erasure.legacy_turns == 1
    left = [d["_id"] for d in await backend.db[CONVERSATIONS].find({}).to_list(None)]
    assert left == (["t-dan"] if erased == "ann" else ["t-ann"])
    assert await backend.db[MIGRATION_STATE].count_documents({"user_id": user_id}) == 0


@pytest.mark.parametrize("resaved", ["not saved again", "saved again by the old service"])
@pytest.mark.parametrize("then", ["erasure", "claim"])
async def test_a_deleted_turns_claim_record_goes_with_it_telling_no_turn_saved_under_its_id_since(
    backend: Backend, then: str, resaved: str
) -> None:
    """A delete takes the claim records of the legacy turns it deletes (`CLAIM_RECORD`): Ann
    (`a`, then `b` by a claim) deletes her conversation; Dan, `a` since a claim of his own,
    starts one under the same id and turn id, whose dual-written copy has the same `_id`.
    Ann's erasure and her next claim leave Dan's copy, whether or not the old service saved
    Ann's moved copy again in place, without `claimed_from`, before her delete (was: her
    claim record, left behind, read his copy naming `a` as hers: her erasure took it, her
    claim moved it)."""
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    ann = [{"role": "user", "content": "ANN q"}, {"role": "assistant", "content": "ANN a"}]
    await logger.log_messages("c1", ann, user_id="a", turn_id="t1")
    await store.claim("a", "b")
    if resaved == "saved again by the old service":  # from its cache: `a`, no `claimed_from`
        unclaimed = {"$set": {"user_id": "a"}, "$unset": {CLAIMED_FROM: ""}}
        await backend.db[LEGACY_TURNS].update_many({}, unclaimed)
    await store.delete("c1", user_id="b")
    await store.claim("d", "a")
    dan = [{"role": "user", "content": "DAN q"}, {"role": "assistant", "content": "DAN a"}]
    await logger.log_messages("c1", dan, user_id="a", turn_id="t1")

    if then == "erasure":
        assert (await store.erase_user("b")).legacy_turns == 0
    else:
        assert (await store.claim("b", "e")).legacy_turns == 0

    copies = await backend.db[LEGACY_TURNS].find({}).to_list(None)
    assert [(c["user_id"], c.get(CLAIMED_FROM)) for c in copies] == [("a", None)]
    assert await backend.db[MIGRATION_STATE].count_documents({"user_id": "b"}) == 0


@_RESAVE_STORIES
async def test_a_moved_turn_the_old_service_saves_again_in_place_stays_its_claimers_to_a_claim(
    backend: Backend, claims: tuple[tuple[str, str], ...], resaved: str, ann: str, dan: str
) -> None:
    """A claim of the user a re-saved moved turn is the claimer's (its claim record) moves it,
    its record with it, and a claim of the user id it names as stored leaves it: Ann's
    claim to `ann-new` takes her turn alone, whichever was saved again."""
    store = await _resaved_after_claims(backend, claims, resaved)

    claimed = await store.claim(ann, "ann-new")
    erasure = await store.erase_user("ann-new")

    assert claimed.legacy_turns == 1
    assert erasure.legacy_turns == 1
    left = [d["_id"] for d in await backend.db[CONVERSATIONS].find({}).to_list(None)]
    assert left == ["t-dan"]


class _StopsMoving:
    """A collection whose `update_many` fails (a claim stopped after recording its turns,
    before moving them); everything else as `collection` does it."""

    def __init__(self, collection: Any) -> None:
        self._collection = collection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collection, name)

    async def update_many(self, *args: Any, **kwargs: Any) -> Any:
        raise AutoReconnect("stopped")


async def test_a_claim_stopped_between_recording_its_turns_and_moving_them_moves_them_again(
    backend: Backend,
) -> None:
    """A claim records each turn it moves (`CLAIM_RECORD`) before moving it: stopped between
    the two, the turns stay the old id's (no turn of the conversation carries a claim, so no
    read looks the records up), and the claim run again moves them, its records the same
    (one per turn, the user id it moved them from once)."""
    turns = [{**t, "conversation_id": "c-late"} for t in example_legacy_turns()]
    await backend.db[CONVERSATIONS].insert_many(turns)
    legacy = LegacyTurns(backend.db)
    store = ConversationStore(backend.db, legacy=legacy)
    legacy._conversations = _StopsMoving(legacy._conversations)  # type: ignore[assignment]
    with pytest.raises(StorageUnavailable):
        await store.claim(EXAMPLE_USER_ID, "user-claimed")
    recorded = await backend.db[MIGRATION_STATE].find({}, {"at": 0}).to_list(None)
    assert len(recorded) == len(turns)
    legacy._conversations = legacy._conversations._collection  # type: ignore[attr-defined]

    claimed = await store.claim(EXAMPLE_USER_ID, "user-claimed")

    assert claimed.legacy_turns == len(turns)
    assert await backend.db[MIGRATION_STATE].find({}, {"at": 0}).to_list(None) == recorded
    assert {tuple(r["claimed_from"]) for r in recorded} == {(EXAMPLE_USER_ID,)}
    erased = await store.erase_user("user-claimed")
    assert erased.legacy_turns == len(turns)
    assert await backend.db[MIGRATION_STATE].count_documents({}) == 0


async def test_a_read_of_legacy_turns_no_claim_moved_asks_for_no_claim_record(
    wire_backend: Backend,
) -> None:
    """The claim records (`CLAIM_RECORD`) are looked up only with a read finding a turn a claim
    moved (`claim_records_owed`): the read fallback of a conversation no claim moved sends
    what it sent before the records (seven finds), a claimed one two finds more (its
    ownership read and its whole read each look its turns' records up)."""
    await wire_backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    store = ConversationStore(wire_backend.db, legacy=LegacyTurns(wire_backend.db))
    wire_backend.commands.clear()
    await store.transcript(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    assert wire_backend.commands.names == ["find"] * 7
    await store.claim(EXAMPLE_USER_ID, "user-claimed")

    wire_backend.commands.clear()
    await store.transcript(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")

    assert wire_backend.commands.names == ["find"] * 9


@pytest.mark.parametrize("by", ["erasure", "claim"])
async def test_the_old_ids_erasure_or_claim_leaves_a_claimed_conversations_turns_not_moved_yet(
    backend: Backend, by: str
) -> None:
    """A conversation whose every turn still stands in `agent_conversations` (the old service
    logs there, no run moved them aside yet) records its claim there: a later turn there
    naming the pre-claim user id is the claimer's, so the old id's erasure, or a second
    claim of it, leaves it, and the claimer's erasure takes it."""
    turns = [{**t, "conversation_id": "c-late"} for t in example_legacy_turns()]
    await backend.db[CONVERSATIONS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(EXAMPLE_USER_ID, "user-claimed")
    later = {**turns[0], "_id": "t-later", "created_at": "2030-01-01T00:00:00Z"}
    await backend.db[CONVERSATIONS].insert_one(later)

    if by == "erasure":
        done = await store.erase_user(EXAMPLE_USER_ID)
    else:
        done = await store.claim(EXAMPLE_USER_ID, "user-other")

    assert done.legacy_turns == 0
    assert await backend.db[CONVERSATIONS].find_one({"_id": "t-later"}) == later
    erased = await store.erase_user("user-claimed")
    assert erased.legacy_turns == len(turns) + 1
    assert await backend.db[CONVERSATIONS].find_one({"_id": "t-later"}) is None


@pytest.mark.parametrize("by", ["delete", "erasure"])
async def test_a_prompt_naming_the_user_a_claim_moved_its_conversation_from_is_the_claimers(
    backend: Backend, by: str
) -> None:
    """A `session_hitl` prompt the old service raises after a claim naming the pre-claim user
    id in the claimed conversation is the claimer's, as a turn it logs so is (`claimers`):
    the claimer is asked it, the old id is served nothing; the old id's erasure and a second
    claim of it leave it, the claimer's delete and erasure take it."""
    turns = example_legacy_turns()
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(EXAMPLE_USER_ID, "user-claimed")
    prompt = {"_id": "p-late", "conversation_id": EXAMPLE_CONVERSATION_ID,
              "user_id": EXAMPLE_USER_ID, "request_id": "req-late", "action": "confirm_booking",
              "status": "pending"}  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(prompt)

    asked = await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")

    assert asked.pending_hitl is not None
    assert asked.pending_hitl.request_id == "req-late"
    with pytest.raises(NotFound):
        await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    await store.erase_user(EXAMPLE_USER_ID)
    await store.claim(EXAMPLE_USER_ID, "user-other")
    assert await backend.db[SESSION_HITL].find_one({"_id": "p-late"}) == prompt
    if by == "delete":
        await store.delete(EXAMPLE_CONVERSATION_ID, user_id="user-claimed")
    else:
        await store.erase_user("user-claimed")
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


async def test_the_claimers_answer_marks_resolved_a_prompt_naming_the_user_a_claim_moved_from(
    backend: Backend,
) -> None:
    """The dual write of the claimer's answer (`prompt_resolved`) reads the conversation's
    prompts through the claims its turns record, as the read fallback and `run` do: a
    `session_hitl` prompt the old service raised after the claim naming the pre-claim user
    id is marked resolved, so after a rollback the old service asks it no more; another
    user's prompt of the same request id stays pending (was: read as stored, the prompt left
    pending and an answer record written beside it)."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    await store.claim(EXAMPLE_USER_ID, "user-claimed")
    await AgentMessageLogger(backend.db).log_messages(
        EXAMPLE_CONVERSATION_ID, [{"role": "user", "content": "pay?"}], user_id="user-claimed"
    )
    await backend.db[SESSION_HITL].insert_many(
        [
            {"_id": f"p-{user}", "conversation_id": EXAMPLE_CONVERSATION_ID, "user_id": user,
             "request_id": "req-late", "action": "confirm_booking", "status": "pending"}
            for user in (EXAMPLE_USER_ID, "user-other")
        ]
    )  # fmt: skip

    await LegacyTurns(backend.db, dual_write=True).prompt_resolved(
        EXAMPLE_CONVERSATION_ID, "req-late"
    )

    prompts = await backend.db[SESSION_HITL].find({}, {"status": 1}).to_list(None)
    assert {p["_id"]: p["status"] for p in prompts} == {
        f"p-{EXAMPLE_USER_ID}": "resolved",
        "p-user-other": "pending",
    }


@pytest.mark.parametrize("created_at", ["2026-03-02T09:00:00Z", datetime(2026, 3, 2, tzinfo=UTC)])
async def test_erasing_a_user_takes_a_late_legacy_turn_of_theirs_no_run_has_moved_aside(
    backend: Backend, created_at: Any
) -> None:
    """An old-service writer still running after the move logs legacy turns into
    `agent_conversations`: no conversation document, they are erased as legacy turns, the
    user's conversations with them, whatever their `created_at` holds."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await log_example(AgentMessageLogger(backend.db))
    late = {**example_legacy_turns()[0], "_id": bson.ObjectId(), "created_at": created_at}
    await backend.db[CONVERSATIONS].insert_one(late)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    erased = await store.erase_user(EXAMPLE_USER_ID)

    assert (erased.conversations, erased.messages, erased.legacy_turns) == (1, 12, 5)
    for name in (CONVERSATIONS, MESSAGES, LEGACY_TURNS):
        assert await backend.db[name].count_documents({}) == 0, name


@pytest.mark.parametrize("fallback", [True, False], ids=["read-fallback", "no-fallback"])
@pytest.mark.parametrize("created_at", ["2026-03-02T09:00:00Z", datetime(2026, 3, 2, tzinfo=UTC)])
async def test_listings_and_exports_never_serve_a_late_legacy_turn_as_a_conversation(
    backend: Backend, fallback: bool, created_at: Any
) -> None:
    """A legacy turn an old-service writer logged into `agent_conversations` after the move
    is no conversation: a user's list, the operator's list of every user's, and an export
    list the conversations only, as erasure and claim tell them apart."""
    await log_example(AgentMessageLogger(backend.db))
    late = {**example_legacy_turns()[0], "_id": bson.ObjectId(), "created_at": created_at}
    await backend.db[CONVERSATIONS].insert_one(late)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db, read_fallback=fallback))

    listed = await store.list_conversations(EXAMPLE_USER_ID)
    recent = await store.recent_conversations()
    exported = [c async for c in store.stream_user_conversations(EXAMPLE_USER_ID)]

    for conversations in (listed.data, recent.data, exported):
        assert [c.id for c in conversations] == [EXAMPLE_CONVERSATION_ID]


@pytest.mark.parametrize("legacy_too", [True, False], ids=["legacy-turns", "store-only"])
async def test_erasing_a_user_takes_a_late_legacy_turn_naming_no_user_of_their_conversation(
    backend: Backend, legacy_too: bool
) -> None:
    """A late legacy turn of a conversation the user owns (in the store or as legacy turns)
    that names no user is the user's part of it, as in the legacy collection: the erasure
    takes it, and no later run brings the conversation back with the user's words."""
    if legacy_too:
        await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await log_example(AgentMessageLogger(backend.db))
    late = {**example_legacy_turns()[0], "_id": bson.ObjectId(), "user_id": None}
    late["created_at"] = "2026-03-02T09:00:00Z"
    await backend.db[CONVERSATIONS].insert_one(late)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    erased = await store.erase_user(EXAMPLE_USER_ID)

    assert erased.legacy_turns == (5 if legacy_too else 1)
    for name in (CONVERSATIONS, MESSAGES, LEGACY_TURNS):
        assert await backend.db[name].count_documents({}) == 0, name


def late_legacy_turn(turn_id: str, user_id: str | None, conversation_id: str) -> dict[str, Any]:
    """A legacy turn an old-service writer logged into `agent_conversations` after the move,
    naming `user_id` under `conversation_id`."""
    late = {**example_legacy_turns()[0], "_id": turn_id, "user_id": user_id}
    return {**late, "conversation_id": conversation_id, "created_at": "2026-03-02T09:00:00Z"}


@pytest.mark.parametrize("legacy_only", [False, True], ids=["live", "legacy-only"])
@pytest.mark.parametrize("deleter", [EXAMPLE_USER_ID, None], ids=["owner", "service"])
async def test_deleting_a_conversation_takes_its_owners_late_legacy_turns_no_run_has_moved_aside(
    backend: Backend, legacy_only: bool, deleter: str | None
) -> None:
    """The late legacy turns under the conversation's id in `agent_conversations` naming its
    owner, or naming no user, are the owner's part of it, as for an erasure: the delete
    takes them and counts them, so no later run brings the conversation back with the
    deleted words. Another user's late turn under the id, and the owner's under another id,
    stay."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    if not legacy_only:
        await log_example(AgentMessageLogger(backend.db))
    await backend.db[CONVERSATIONS].insert_many(
        [late_legacy_turn("late-owner", EXAMPLE_USER_ID, EXAMPLE_CONVERSATION_ID),
         late_legacy_turn("late-none", None, EXAMPLE_CONVERSATION_ID),
         late_legacy_turn("late-other", "user-other", EXAMPLE_CONVERSATION_ID),
         late_legacy_turn("late-elsewhere", EXAMPLE_USER_ID, "conv-elsewhere")]
    )  # fmt: skip
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    deleted = await store.delete(EXAMPLE_CONVERSATION_ID, user_id=deleter)

    assert deleted.legacy_turns == 4 + 2
    left = await backend.db[CONVERSATIONS].find({}, {"_id": 1}).to_list(None)
    assert sorted(d["_id"] for d in left) == ["late-elsewhere", "late-other"]


@pytest.mark.parametrize(
    "late_owner", [EXAMPLE_USER_ID, "user-other", None], ids=["owner", "another-user", "no-user"]
)
async def test_a_late_legacy_turn_under_a_legacy_conversations_id_is_never_taken_for_its_document(
    backend: Backend, late_owner: str | None
) -> None:
    """MIGRATION.md (`relocate.held_by_left`): a late legacy turn of another conversation
    whose `_id` is a legacy conversation's id is no conversation document of that id
    (`conversation_by_id`): the read fallback serves the conversation from its legacy turns,
    every write to it is refused as not migrated yet (a user token not its owner's finds
    nothing), its owner's delete takes its legacy turns only, and the late turn stays as it
    was logged, whoever it names."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    late = late_legacy_turn(EXAMPLE_CONVERSATION_ID, late_owner, "conv-elsewhere")
    await backend.db[CONVERSATIONS].insert_one(late)
    legacy = LegacyTurns(backend.db)
    store = ConversationStore(backend.db, legacy=legacy)
    logger = AgentMessageLogger(backend.db, legacy=legacy)
    expected = convert(example_legacy_turns())
    hi = [{"role": "user", "content": "hi"}]

    for user_id in (EXAMPLE_USER_ID, None):
        served = await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id=user_id)
        assert served.turn_count == expected.conversation.turn_count
        assert await store.transcript(EXAMPLE_CONVERSATION_ID, user_id=user_id) == (
            expected.messages
        )
        page = await store.messages_page(EXAMPLE_CONVERSATION_ID, user_id=user_id, limit=100)
        assert page.data == expected.messages
    for user_id, owner_only in [(EXAMPLE_USER_ID, True), (None, False)]:
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await logger.log_messages(
                EXAMPLE_CONVERSATION_ID, hi, user_id=user_id, owner_only=owner_only
            )
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await logger.upsert_conversation(EXAMPLE_CONVERSATION_ID, user_id=user_id)
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await store.rename(EXAMPLE_CONVERSATION_ID, "New name", user_id=user_id)
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await SteeringInbox(logger).open_turn(
                EXAMPLE_CONVERSATION_ID, "run-1", user_id=user_id, strict_owner=owner_only
            )
    with pytest.raises(NotFound):
        await logger.log_messages(EXAMPLE_CONVERSATION_ID, hi, user_id="user-other",
                                  owner_only=True)  # fmt: skip
    with pytest.raises(NotFound):
        await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id="user-other")
    assert await backend.db[CONVERSATIONS].find_one({"_id": EXAMPLE_CONVERSATION_ID}) == late

    deleted = await store.delete(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)

    assert (deleted.conversations, deleted.legacy_turns) == (0, 4)
    assert await backend.db[CONVERSATIONS].find_one({"_id": EXAMPLE_CONVERSATION_ID}) == late


@pytest.mark.parametrize("wired", [True, False], ids=["legacy-wired", "store-only"])
async def test_a_late_legacy_turns_id_is_no_conversation_and_none_is_created_over_it(
    backend: Backend, wired: bool
) -> None:
    """A late legacy turn whose `_id` is an identifier no conversation has: reads of that id
    find no conversation (NotFound, never its fields read as one), and a write creating one
    there, which would stand where the turn stands, is refused as not migrated yet (to a user
    token the turn does not name: NotFound), nothing written: the turn stays as logged, its
    user's list unchanged."""
    await log_example(AgentMessageLogger(backend.db))
    late = late_legacy_turn("late-1", EXAMPLE_USER_ID, "conv-elsewhere")
    await backend.db[CONVERSATIONS].insert_one(late)
    legacy = LegacyTurns(backend.db)
    store = ConversationStore(backend.db, legacy=legacy)
    logger = AgentMessageLogger(backend.db, legacy=legacy if wired else None)
    hi = [{"role": "user", "content": "hi"}]

    for user_id in (EXAMPLE_USER_ID, None):
        with pytest.raises(NotFound):
            await store.get_conversation("late-1", user_id=user_id)
        with pytest.raises(NotFound):
            await store.transcript("late-1", user_id=user_id)
        with pytest.raises(NotFound):
            await store.rename("late-1", "New name", user_id=user_id)
        with pytest.raises(NotFound):
            await store.delete("late-1", user_id=user_id)
        with pytest.raises(NotFound):
            await SteeringInbox(logger).open_turn("late-1", "run-1", user_id=user_id)
    for user_id, owner_only in [(EXAMPLE_USER_ID, True), (None, False)]:
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await logger.log_messages("late-1", hi, user_id=user_id, owner_only=owner_only)
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await logger.upsert_conversation("late-1", user_id=user_id)
        with pytest.raises(Conflict, match="exists as legacy turns not migrated yet"):
            await logger.upsert_conversation("late-1", user_id=user_id, create_only=True)
    with pytest.raises(NotFound):
        await logger.log_messages("late-1", hi, user_id="user-other", owner_only=True)

    assert await backend.db[CONVERSATIONS].find_one({"_id": "late-1"}) == late
    listed = await store.list_conversations(EXAMPLE_USER_ID)
    assert [c.id for c in listed.data] == [EXAMPLE_CONVERSATION_ID]


async def test_deleting_a_conversation_takes_a_late_legacy_turn_a_run_was_moving_aside(
    backend: Backend,
) -> None:
    """A run moving a late legacy turn aside inserts it into the legacy collection before it
    deletes it from `agent_conversations`: a delete meanwhile (here: the run stopped between
    the two) takes it from both, so the resumed run has nothing of it to move back."""
    await log_example(AgentMessageLogger(backend.db))
    late = late_legacy_turn("late-owner", EXAMPLE_USER_ID, EXAMPLE_CONVERSATION_ID)
    await backend.db[LEGACY_TURNS].insert_one(late)
    await backend.db[CONVERSATIONS].insert_one(late)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    await store.delete(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)

    for name in (CONVERSATIONS, MESSAGES, LEGACY_TURNS):
        assert await backend.db[name].count_documents({}) == 0, name


class _MovedAsideAfterTheFirstLook:
    """The legacy collection, whose first read is followed by a run moving every late legacy
    turn aside whole (copied, then deleted from `agent_conversations`) before the caller goes
    on."""

    def __init__(self, db: Any) -> None:
        self.db, self.wrapped, self.moved = db, db[LEGACY_TURNS], False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def with_options(self, **_: Any) -> Any:
        """Itself, read as stored (`read_as_stored`): the turns it holds are valid text."""
        return self

    def find(self, *args: Any, **kwargs: Any) -> Any:
        cursor, outer = self.wrapped.find(*args, **kwargs), self

        class Then:
            async def to_list(self, length: int | None) -> Any:
                found = await cursor.to_list(length)
                if not outer.moved:
                    outer.moved = True
                    late = (
                        await outer.db[CONVERSATIONS]
                        .find({"_id": {"$regex": "^late-"}})
                        .to_list(None)
                    )
                    await outer.wrapped.insert_many(late)
                    ids = [turn["_id"] for turn in late]
                    await outer.db[CONVERSATIONS].delete_many({"_id": {"$in": ids}})
                return found

        return Then()


@pytest.mark.parametrize("forget", ["delete", "erase"])
async def test_late_legacy_turns_a_run_moves_aside_between_two_looks_of_a_delete_all_go(
    backend: Backend, forget: str
) -> None:
    """A run moves the late legacy turns aside whole (copies, then the turns deleted from
    `agent_conversations`) right after a delete, or an erasure, first read the legacy
    collection: it takes them from the legacy collection all the same, so no later run brings
    them back; each counted once."""
    await log_example(AgentMessageLogger(backend.db))
    await backend.db[CONVERSATIONS].insert_many(
        [late_legacy_turn("late-owner", EXAMPLE_USER_ID, EXAMPLE_CONVERSATION_ID),
         late_legacy_turn("late-none", None, EXAMPLE_CONVERSATION_ID)]
    )  # fmt: skip
    legacy = LegacyTurns(backend.db)
    legacy._turns = _MovedAsideAfterTheFirstLook(backend.db)
    store = ConversationStore(backend.db, legacy=legacy)

    if forget == "delete":
        done = await store.delete(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    else:
        done = await store.erase_user(EXAMPLE_USER_ID)

    assert done.legacy_turns == 2
    for name in (CONVERSATIONS, MESSAGES, LEGACY_TURNS):
        assert await backend.db[name].count_documents({}) == 0, name


@pytest.mark.parametrize("forget", ["delete", "erase"])
async def test_a_late_legacy_turn_a_run_was_moving_aside_is_counted_once(
    backend: Backend, forget: str
) -> None:
    """A late turn a run copied and has not deleted from `agent_conversations` yet is taken
    from both collections by a delete, or an erasure: one turn, counted once in
    `legacy_turns`, beside a late turn the run had not reached."""
    await log_example(AgentMessageLogger(backend.db))
    late = late_legacy_turn("late-owner", EXAMPLE_USER_ID, EXAMPLE_CONVERSATION_ID)
    await backend.db[LEGACY_TURNS].insert_one(late)
    await backend.db[CONVERSATIONS].insert_many(
        [late, late_legacy_turn("late-unread", EXAMPLE_USER_ID, EXAMPLE_CONVERSATION_ID)]
    )
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    if forget == "delete":
        done = await store.delete(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    else:
        done = await store.erase_user(EXAMPLE_USER_ID)

    assert done.legacy_turns == 2


async def test_a_claim_moves_a_late_legacy_turn_and_counts_conversations_only(
    backend: Backend,
) -> None:
    await log_example(AgentMessageLogger(backend.db))
    late = {**example_legacy_turns()[0], "created_at": "2026-03-02T09:00:00Z"}
    await backend.db[CONVERSATIONS].insert_one(late)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    claimed = await store.claim(EXAMPLE_USER_ID, "user-claimed")

    assert (claimed.conversations, claimed.legacy_turns) == (1, 1)
    moved = await backend.db[CONVERSATIONS].find_one({"_id": late["_id"]})
    assert moved is not None
    assert (moved["user_id"], moved["created_at"]) == ("user-claimed", late["created_at"])


async def test_erasing_a_user_leaves_the_legacy_conversations_others_own(backend: Backend) -> None:
    """Only the user's own turns go from a conversation another user owns."""
    turns = example_legacy_turns()
    owner = turns[-1]["user_id"]
    turns[0]["user_id"] = "user-guest"  # the guest spoke first; the owner named the last turn
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    erased = await store.erase_user("user-guest")

    assert erased.legacy_turns == 1
    remaining = await backend.db[LEGACY_TURNS].find({}).to_list(None)
    assert {t["user_id"] for t in remaining} == {owner}
    assert len(remaining) == len(turns) - 1


async def test_a_migrated_conversation_is_read_from_the_new_collections(backend: Backend) -> None:
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await log_example(AgentMessageLogger(backend.db))
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    transcript = await store.transcript(EXAMPLE_CONVERSATION_ID)
    assert transcript[0].turn_id == "turn-1"


async def marked_as_being_migrated(backend: Backend) -> ConversationStore:
    """The example conversation stored with its legacy turns beside it (dual write), its
    document then marked as a migration run marks the one it is writing (`migrating`): the
    store reading it, the read fallback on."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    await logger.ensure_indexes()
    await log_example(logger)
    marked = {"$set": {"migrating": True}}
    await backend.db[CONVERSATIONS].update_one({"_id": EXAMPLE_CONVERSATION_ID}, marked)
    return ConversationStore(backend.db, legacy=LegacyTurns(backend.db))


async def test_a_conversation_being_migrated_is_listed_and_exported_as_its_reads_serve_it(
    backend: Backend,
) -> None:
    """A conversation a migration run is writing is served from its legacy turns: lists show
    it (its document's summary) and the export holds it with the transcript the fallback
    serves; without the fallback no read serves it, and none lists it. One a delete marked
    since is left out, as ever."""
    store = await marked_as_being_migrated(backend)
    served = await store.transcript(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)

    listed = await store.list_conversations(EXAMPLE_USER_ID)
    recent = await store.recent_conversations()
    exported = [e async for e in store.export_user(EXAMPLE_USER_ID)]

    assert [c.id for c in listed.data] == [EXAMPLE_CONVERSATION_ID]
    assert [c.id for c in recent.data] == [EXAMPLE_CONVERSATION_ID]
    assert [(e.conversation.id, e.messages) for e in exported] == [
        (EXAMPLE_CONVERSATION_ID, served)
    ]
    unserved = ConversationStore(backend.db, legacy=LegacyTurns(backend.db, read_fallback=False))
    with pytest.raises(NotFound):
        await unserved.get_conversation(EXAMPLE_CONVERSATION_ID)
    assert (await unserved.list_conversations(EXAMPLE_USER_ID)).data == []
    assert [e async for e in unserved.export_user(EXAMPLE_USER_ID)] == []
    deleting = {"$set": {"deleting_since": utc_now()}}
    await backend.db[CONVERSATIONS].update_one({"_id": EXAMPLE_CONVERSATION_ID}, deleting)
    assert (await store.list_conversations(EXAMPLE_USER_ID)).data == []
    assert [e async for e in store.export_user(EXAMPLE_USER_ID)] == []


async def test_what_is_stored_of_a_conversation_being_migrated_is_read_as_it_stands(
    backend: Backend,
) -> None:
    """What the new collections hold of a conversation a migration run is writing, or one a
    stopped run left marked, is read as it stands for an operator comparing it with the
    legacy turns (`stored_conversation`, `stored_transcript`), whatever the read fallback:
    the document marked `migrating`, and the messages stored so far. One a delete marked is
    no conversation; one not migrated yet has none stored."""
    store = await marked_as_being_migrated(backend)
    stored = await backend.db[MESSAGES].find({}, {"_id": 1}).sort("seq", 1).to_list(None)
    unserved = ConversationStore(backend.db, legacy=LegacyTurns(backend.db, read_fallback=False))

    for reader in (store, unserved):
        conversation = await reader.stored_conversation(EXAMPLE_CONVERSATION_ID)
        messages = await reader.stored_transcript(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
        assert (conversation.id, conversation.migrating) == (EXAMPLE_CONVERSATION_ID, True)
        assert [m.id for m in messages] == [d["_id"] for d in stored]
    with pytest.raises(NotFound):
        await store.stored_conversation("conv-not-migrated")
    assert await store.stored_transcript("conv-not-migrated") == []
    deleting = {"$set": {"deleting_since": utc_now()}}
    await backend.db[CONVERSATIONS].update_one({"_id": EXAMPLE_CONVERSATION_ID}, deleting)
    with pytest.raises(NotFound):
        await store.stored_conversation(EXAMPLE_CONVERSATION_ID)
    with pytest.raises(NotFound):
        await store.stored_transcript(EXAMPLE_CONVERSATION_ID)


async def test_a_conversation_being_migrated_is_found_by_search_in_its_stored_messages(
    backend: Backend,
) -> None:
    backend.skip_if_lacking("text_search")
    store = await marked_as_being_migrated(backend)

    by_user = await store.search("Paris", user_id=EXAMPLE_USER_ID)
    in_it = await store.search("Paris", conversation_id=EXAMPLE_CONVERSATION_ID)

    assert by_user
    assert {h.message.conversation_id for h in by_user} == {EXAMPLE_CONVERSATION_ID}
    assert [h.message.id for h in in_it] == [h.message.id for h in by_user]


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_a_conversation_being_migrated_pages_after_a_message_as_the_fallback_serves_it(
    backend: Backend, order: Literal["asc", "desc"]
) -> None:
    """Pages of a conversation a migration run is writing are the read fallback's, `after` a
    message it serves too; `after` a message it does not serve (one stored, not in its legacy
    turns) is 422, as for any message not in the conversation, never 404: it is served."""
    store = await marked_as_being_migrated(backend)
    stored = await backend.db[MESSAGES].find({}, {"_id": 1}).to_list(None)
    served = await store.transcript(EXAMPLE_CONVERSATION_ID)
    served = served[::-1] if order == "desc" else served

    page = await store.messages_page(
        EXAMPLE_CONVERSATION_ID, after=served[1].id, limit=3, order=order
    )

    assert page.data == served[2:5]
    assert page.has_more
    assert {m.id for m in served}.isdisjoint(d["_id"] for d in stored)
    with pytest.raises(InvalidInput, match="not in this conversation"):
        await store.messages_page(EXAMPLE_CONVERSATION_ID, after=stored[0]["_id"], order=order)


@pytest.mark.wire
async def test_a_migrated_transcript_still_costs_one_round_trip(wire_backend: Backend) -> None:
    """Its messages and its document, read at once: no lookup of the legacy turns."""
    assert wire_backend.commands is not None
    await wire_backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    await log_example(AgentMessageLogger(wire_backend.db))
    wire_backend.commands.clear()
    await ConversationStore(wire_backend.db, legacy=LegacyTurns(wire_backend.db)).transcript(
        EXAMPLE_CONVERSATION_ID
    )
    assert wire_backend.commands.names == ["find", "find"]


async def test_a_prompt_is_reached_by_its_session_id_only_when_it_names_no_conversation(
    backend: Backend,
) -> None:
    """As the migration reads them: a conversation id another user's prompt names as its
    session cannot reach it."""
    legacy = LegacyTurns(backend.db)
    prompts = backend.db[SESSION_HITL]
    await prompts.insert_many(
        [
            {"_id": "p-named", "conversation_id": "conv-b", "session_id": "sess-7",
             "request_id": "r-7", "action": "pay"},
            {"_id": "p-session", "session_id": "sess-9", "request_id": "r-9", "action": "pay"},
        ]
    )  # fmt: skip

    await legacy.delete("sess-7", owner=None)
    await legacy.delete("sess-9", owner=None)

    assert [p["_id"] for p in await prompts.find().to_list(None)] == ["p-named"]


@pytest.mark.parametrize("cid", ["conv-plain", "legacy-turn-abc"])
async def test_a_deleted_conversation_leaves_no_dual_written_turn_to_come_back(
    backend: Backend, cid: str
) -> None:
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    store = ConversationStore(backend.db, legacy=legacy)
    if is_derived_id(cid):  # only the migration creates it: here, as one with no turns
        now = utc_now()
        await backend.db[CONVERSATIONS].insert_one(
            {"_id": cid, "created_at": now, "updated_at": now, "message_count": 0}
        )
    await logger.log_messages(cid, [{"role": "user", "content": "hi"}], turn_id="t1")

    deleted = await store.delete(cid)

    assert deleted.legacy_turns == 1
    with pytest.raises(NotFound):
        await store.get_conversation(cid)


async def test_legacy_ids_stored_as_numbers_are_the_ids_the_migration_reads_them_as(
    backend: Backend,
) -> None:
    """5 and 5.0 are one conversation, "5" (one value to the old service's query), -5 another
    ("-5"); "5.0" names none of them; an ObjectId's prompt is its conversation's. The last
    user its turns name owns "5"; a delete by that owner leaves the other user's turn."""
    from bson import ObjectId

    oid = ObjectId()
    for key, (cid, owner) in enumerate(
        [(5, "u-int"), (5.0, "u-double"), (-5, "u-negative"), (oid, "u-oid")]
    ):
        await backend.db[LEGACY_TURNS].insert_one(
            {"_id": f"t-{key}", "conversation_id": cid, "user_id": owner, "user_message": "hi",
             "response_parts": [{"type": "text", "content": "hello"}]}
        )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"conversation_id": oid, "request_id": "r-1", "action": "pay", "status": "pending"}
    )
    legacy = LegacyTurns(backend.db)

    owners = {cid: await legacy.holder(cid) for cid in ("5", "5.0", "-5", str(oid), "6")}
    assert {cid: h.user_id if h else None for cid, h in owners.items()} == {
        "5": "u-double", "5.0": None, "-5": "u-negative", str(oid): "u-oid", "6": None,
    }  # fmt: skip
    found = await legacy.conversation(str(oid))
    assert found is not None
    assert found.conversation.pending_hitl is not None
    assert await legacy.delete("5", owner="u-double") == 1
    left = await legacy.holder("5")
    assert left is not None
    assert left.user_id == "u-int"
    assert await legacy.delete(str(oid), owner="u-oid") == 1
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


async def test_dual_write_keeps_a_turn_whole_for_the_legacy_reader(backend: Backend) -> None:
    """Texts cut to their bound go back whole; a system prompt beside a user's message is a
    system turn of its own; sums stay within 2**53 - 1 as int64."""
    from bson import Int64

    from agent_store import TurnRules

    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(
        backend.db, observers=[legacy], rules=TurnRules(max_message_bytes=16_384)
    )
    long_text = "word " * 8_000
    usage = {"input_tokens": 2**53 - 1, "output_tokens": 2}
    await logger.log_messages(
        "conv-dual",
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": long_text},
         {"role": "assistant", "content": "ok", "token_usage": usage, "latency_ms": 2**53 - 1},
         {"role": "assistant", "content": "done", "token_usage": usage, "latency_ms": 5}],
        turn_id="t-1",
    )  # fmt: skip

    documents = await backend.db[LEGACY_TURNS].find().to_list(None)
    converted = convert(documents)

    assert [(m.role, m.content) for m in converted.messages] == [
        ("system", "You are terse."), ("user", long_text), ("assistant", "ok"),
        ("assistant", "done"),
    ]  # fmt: skip
    main = next(d for d in documents if not d["is_system"])
    assert main["token_usage"] == {"input_tokens": 2**53 - 1, "output_tokens": 4}
    assert main["latency_ms"] == 2**53 - 1
    if backend.name != "mongomock":  # mongomock keeps Python ints as they are
        assert type(main["latency_ms"]) is Int64


@pytest.mark.parametrize(
    ("where", "text"),
    [
        ("result", '{"id": 12345678901234567890}'),
        ("result", '{"id": -12345678901234567890}'),
        ("result", '[{"\\u0000": 2}]'),
        ("arguments", '{"id":12345678901234567890}'),
    ],
    ids=["an integer past int64", "a negative past int64", "a key holding NUL", "arguments"],
)
async def test_dual_write_keeps_as_text_json_that_bson_cannot_hold(
    backend: Backend, where: str, text: str
) -> None:
    """A tool result (or a call's arguments) whose JSON text says what BSON cannot hold is
    dual-written as its text, which the legacy format takes too: the turn is logged, its copy
    written, and the copy converts back to the messages stored."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy])
    arguments, result = (text, "r") if where == "arguments" else ("{}", text)
    call = {"id": "k1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    await logger.log_messages(
        "conv-json",
        [{"role": "user", "content": "q"},
         {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "k1", "content": result},
         {"role": "assistant", "content": "ok"}],
        turn_id="t-1",
    )  # fmt: skip

    documents = await backend.db[LEGACY_TURNS].find().to_list(None)
    stored = await ConversationStore(backend.db).transcript("conv-json")
    converted = convert(documents)

    assert len(documents) == 1
    assert converted.problems == []
    assert visible(converted.messages) == visible(stored)
    assert differences(from_legacy(parse_turns(documents)), from_messages(stored)) == []


async def test_dual_write_keeps_a_text_cut_when_whole_it_would_not_fit_a_document(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 16 MiB the legacy turn keeps the cut text: the turn is never lost over it."""
    from agent_store import TurnRules
    from agent_store.legacy import _source

    monkeypatch.setattr(_source, "MAX_LEGACY_DOCUMENT_BYTES", 30_000)
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(
        backend.db, observers=[legacy], rules=TurnRules(max_message_bytes=16_384)
    )
    await logger.log_messages("conv-big", [{"role": "user", "content": "x" * 40_000}], turn_id="t")

    (document,) = await backend.db[LEGACY_TURNS].find().to_list(None)
    assert 0 < len(document["user_message"]) < 40_000


async def test_dual_write_documents_of_one_turn_are_named_apart_from_every_turn_id(
    backend: Backend,
) -> None:
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy])
    system_and_user = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "Nine."},
    ]
    await logger.log_messages("conv-named", system_and_user, turn_id="t")
    await logger.log_messages(
        "conv-named", [{"role": "user", "content": "And now?"}], turn_id="t:system"
    )

    documents = await backend.db[LEGACY_TURNS].find().to_list(None)

    assert len(documents) == 3
    assert [m.content for m in convert(documents).messages] == [
        "Be terse.", "Time?", "Nine.", "And now?",
    ]  # fmt: skip


async def test_a_conversation_migrated_under_a_derived_id_reaches_a_legacy_id_stored_as_a_double(
    backend: Backend,
) -> None:
    """1e300 is named by its value, 301 digits, which is no identifier: the migration derives
    an id."""
    from agent_store.legacy import derived_conversation_id, named_id

    named = named_id(1e300)
    assert named is not None
    assert len(named) == 301
    derived = derived_conversation_id(named)
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "t-big", "conversation_id": 1e300, "user_message": "hi"}
    )
    await backend.db["agent_conversations"].insert_one(
        {"_id": derived, "legacy_conversation_id": named, "message_count": 0, "turn_count": 0}
    )

    assert await LegacyTurns(backend.db).delete(derived, owner=None) == 1


# -- deletes and erasures reach one owner's legacy turns and prompts, whole --------------

VICTIM, MALLORY = "user-victim", "user-mallory"


async def test_the_read_fallback_asks_no_request_a_later_record_answered(backend: Backend) -> None:
    """A request recorded pending, then answered in a later `session_hitl` record, is
    answered to the read fallback too, as the migration stores it."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    asked = {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
             "action": "confirm_booking", "status": "pending",
             "created_at": datetime(2024, 3, 1, 10, tzinfo=UTC)}  # fmt: skip
    answered = {**asked, "status": "approved", "resolved": True,
                "created_at": datetime(2024, 3, 1, 10, 2, tzinfo=UTC)}  # fmt: skip
    await backend.db[SESSION_HITL].insert_many([asked, answered])
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    assert await store.pending_hitl(EXAMPLE_CONVERSATION_ID) is None
    conversation = await store.get_conversation(EXAMPLE_CONVERSATION_ID, user_id=EXAMPLE_USER_ID)
    assert conversation.pending_hitl is None


async def test_the_read_fallback_reads_numbers_equal_by_value_as_one_conversation(
    backend: Backend,
) -> None:
    """`42`, `42.0` and `Decimal128("42.0")` name conversation "42", as the old service's
    equality query found them, before the migration as after it."""
    # mongomock matches a Decimal128 by its digits, never by its value (`42` is not `42.0`)
    decimal = bson.Decimal128("42" if backend.name == "mongomock" else "42.0")
    turns = [
        {"_id": f"lt-{n}", "conversation_id": cid, "user_id": "u-1",
         "created_at": datetime(2024, 3, 1, 10, n, tzinfo=UTC), "user_message": f"turn {n}"}
        for n, cid in enumerate([42, 42.0, decimal])
    ]  # fmt: skip
    await backend.db[LEGACY_TURNS].insert_many(turns)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    transcript = await store.transcript("42")

    assert [m.content for m in transcript] == ["turn 0", "turn 1", "turn 2"]
    assert {m.conversation_id for m in transcript} == {"42"}
    with pytest.raises(NotFound):
        await store.transcript("42.0")


def wired(
    backend: Backend, *, dual_write: bool = False
) -> tuple[AgentMessageLogger, ConversationStore]:
    legacy = LegacyTurns(backend.db, dual_write=dual_write)
    observers = [legacy] if dual_write else []
    return (
        AgentMessageLogger(backend.db, observers=observers, legacy=legacy),
        ConversationStore(backend.db, legacy=legacy),
    )


@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_a_legacy_conversations_prompt_goes_with_it(backend: Backend, how: str) -> None:
    """A pending prompt's params may hold an IBAN: it goes with its conversation's turns."""
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "lt-1", "conversation_id": "conv-v", "user_id": VICTIM, "user_message": "pay",
         "response_parts": [{"type": "hitl", "action": "pay", "request_id": "r-1",
                             "params": {"iban": "DE02 1203 0000 0000 2020 51"}}]}
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-1", "conversation_id": "conv-v", "request_id": "r-1", "action": "pay",
         "params": {"iban": "DE02 1203 0000 0000 2020 51"}, "status": "pending"}
    )  # fmt: skip
    _, store = wired(backend)

    if how == "erase the user":
        await store.erase_user(VICTIM)
    else:
        await store.delete("conv-v", user_id=VICTIM)

    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


async def test_erasing_a_user_takes_every_prompt_naming_them(backend: Backend) -> None:
    await backend.db[SESSION_HITL].insert_many(
        [{"_id": "p-mine", "session_id": "s-1", "user_id": VICTIM, "request_id": "r-1"},
         {"_id": "p-other", "session_id": "s-2", "user_id": MALLORY, "request_id": "r-2"}]
    )  # fmt: skip
    _, store = wired(backend)

    await store.erase_user(VICTIM)

    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-other"]


@pytest.mark.parametrize("key", ["session_id", "conversation_id"])
async def test_a_delete_leaves_a_legacy_prompt_naming_another_user(
    backend: Backend, key: str
) -> None:
    """The id exists nowhere but in another user's prompt: Mallory may take it; her delete
    takes her own conversation only."""
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-victim", key: "conv-x", "user_id": VICTIM, "request_id": "r-1"}
    )
    logger, store = wired(backend)
    await logger.log_messages("conv-x", [{"role": "user", "content": "hi"}], user_id=MALLORY,
                              turn_id="t1", owner_only=True)  # fmt: skip

    await store.delete("conv-x", user_id=MALLORY)

    assert await backend.db[SESSION_HITL].count_documents({"_id": "p-victim"}) == 1


async def test_a_delete_leaves_legacy_turns_of_another_user_under_its_id(backend: Backend) -> None:
    """Legacy turns naming the victim appear under Mallory's id (the old writer during a
    rollback window): her delete takes what is hers, not them."""
    logger, store = wired(backend)
    await logger.log_messages("conv-x", [{"role": "user", "content": "hi"}], user_id=MALLORY,
                              turn_id="t1", owner_only=True)  # fmt: skip
    await backend.db[LEGACY_TURNS].insert_many(
        [{"_id": "lt-mallory", "conversation_id": "conv-x", "user_id": MALLORY,
          "user_message": "hers"},
         {"_id": "lt-victim", "conversation_id": "conv-x", "user_id": VICTIM,
          "user_message": "victim's words"}]
    )  # fmt: skip

    deleted = await store.delete("conv-x", user_id=MALLORY)

    assert deleted.legacy_turns == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-victim"]


async def test_deleting_a_legacy_fallback_leaves_the_conversation_another_user_holds_there(
    backend: Backend,
) -> None:
    """The victim holds the id in the new collections; legacy turns under it name Mallory,
    whose token reads them through the fallback. Her delete takes her legacy turns only."""
    logger, store = wired(backend)
    await logger.log_messages("conv-x", [{"role": "user", "content": "hi"}], user_id=VICTIM,
                              turn_id="t1", owner_only=True)  # fmt: skip
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "lt-mallory", "conversation_id": "conv-x", "user_id": MALLORY,
         "user_message": "hers"}
    )  # fmt: skip

    deleted = await store.delete("conv-x", user_id=MALLORY)

    assert (deleted.conversations, deleted.messages, deleted.legacy_turns) == (0, 0, 1)
    assert [m.content for m in await store.transcript("conv-x", user_id=VICTIM)] == ["hi"]
    assert (await store.get_conversation("conv-x", user_id=VICTIM)).message_count == 1


async def test_a_delete_under_a_derived_id_takes_the_prompts_naming_the_legacy_id(
    backend: Backend,
) -> None:
    from agent_store.legacy import derived_conversation_id

    original = "conv with spaces"
    derived = derived_conversation_id(original)
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "t-1", "conversation_id": original, "user_id": VICTIM, "user_message": "hi"}
    )
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-1", "conversation_id": original, "request_id": "r-1", "action": "pay"}
    )
    now = utc_now()
    await backend.db[CONVERSATIONS].insert_one(
        {"_id": derived, "user_id": VICTIM, "legacy_conversation_id": original,
         "created_at": now, "updated_at": now, "message_count": 0}
    )  # fmt: skip

    deleted = await ConversationStore(backend.db, legacy=LegacyTurns(backend.db)).delete(derived)

    assert deleted.legacy_turns == 1
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


def dual_write_held(
    legacy: LegacyTurns, monkeypatch: pytest.MonkeyPatch, turn_id: str
) -> tuple[asyncio.Event, asyncio.Event]:
    """The dual write of `turn_id` waits, its messages stored, until the second event is set
    (the first says it is waiting)."""
    turn_logged, stored, go = legacy.turn_logged, asyncio.Event(), asyncio.Event()

    async def held(turn: Any, conversation: Any) -> None:
        if turn.turn_id == turn_id:
            stored.set()
            await go.wait()
        await turn_logged(turn, conversation)

    monkeypatch.setattr(legacy, "turn_logged", held)
    return stored, go


@pytest.mark.parametrize("legacy_id", [None, "conv gone/é"],
                         ids=["logged live", "migrated under a derived id"])  # fmt: skip
@pytest.mark.parametrize("lands", ["after the delete", "before the document goes"])
async def test_a_deleted_conversation_does_not_come_back_through_a_late_dual_write(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, lands: str, legacy_id: str | None
) -> None:
    """A conversation migrated under a derived id has its turns dual-written under the legacy
    id it stands for: the delete's last step reaches those too."""
    logger, store = wired(backend, dual_write=True)
    legacy = store._legacy_source
    assert isinstance(legacy, LegacyTurns)
    cid = "c-gone"
    if legacy_id is not None:
        old = {"_id": "t-0", "conversation_id": legacy_id, "user_id": VICTIM,
                "created_at": utc_now(), "user_message": "old words"}  # fmt: skip
        cid = await migrated(backend, [old])
    await logger.log_messages(cid, [{"role": "user", "content": "hi"}], user_id=VICTIM,
                              turn_id="t1")  # fmt: skip
    stored, go = dual_write_held(legacy, monkeypatch, "t2")
    turn = asyncio.create_task(
        logger.log_messages(cid, [{"role": "user", "content": "private words"}],
                            user_id=VICTIM, turn_id="t2", owner_only=True)
    )  # fmt: skip
    await stored.wait()
    if lands == "before the document goes":  # after the delete's legacy step
        conversations = store._conversations
        find_one_and_delete = conversations.find_one_and_delete

        async def dual_write_first(*args: Any, **kwargs: Any) -> Any:
            go.set()
            await turn
            return await find_one_and_delete(*args, **kwargs)

        monkeypatch.setattr(conversations, "find_one_and_delete", dual_write_first)

    await store.delete(cid, user_id=VICTIM)
    go.set()
    await turn

    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0
    with pytest.raises(NotFound):
        await store.get_conversation(cid, user_id=VICTIM)


# -- a conversation named by one id never reaches the turns an array id files elsewhere ---

ARRAY_ID = ["conv-x", "other"]
"""A `conversation_id` stored as an array holding `conv-x`: a query matches an array by its
elements, yet the migration files such a turn under a derived id of its own."""


async def seed_array_id(backend: Backend, *, array_owner: str) -> None:
    await backend.db[LEGACY_TURNS].insert_many(
        [{"_id": "lt-x", "conversation_id": "conv-x", "user_id": VICTIM, "user_message": "mine"},
         {"_id": "lt-array", "conversation_id": ARRAY_ID, "user_id": array_owner,
          "user_message": "«FILED UNDER AN ARRAY»"}]
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-array", "conversation_id": ARRAY_ID, "request_id": "r-1", "action": "pay",
         "status": "pending", "user_id": array_owner}
    )  # fmt: skip


async def test_a_legacy_conversation_is_read_without_the_turns_an_array_id_holding_it_files(
    backend: Backend,
) -> None:
    await seed_array_id(backend, array_owner=MALLORY)
    _, store = wired(backend)

    transcript = await store.transcript("conv-x", user_id=VICTIM)

    assert [m.content for m in transcript] == ["mine"]
    assert await store.pending_hitl("conv-x") is None
    with pytest.raises(NotFound):
        await store.transcript("conv-x", user_id=MALLORY)


async def test_deleting_a_legacy_conversation_leaves_the_turns_an_array_id_holding_it_files(
    backend: Backend,
) -> None:
    await seed_array_id(backend, array_owner=VICTIM)
    _, store = wired(backend)

    deleted = await store.delete("conv-x", user_id=VICTIM)

    assert deleted.legacy_turns == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-array"]
    assert await backend.db[SESSION_HITL].count_documents({}) == 1


async def test_erasing_a_user_takes_their_turns_under_an_array_id_and_leaves_the_id_it_holds(
    backend: Backend,
) -> None:
    """The victim's `conv-x` is no conversation of the user the array turn names: erasing
    that user takes the array turn, and `conv-x` stays the victim's."""
    await seed_array_id(backend, array_owner=MALLORY)
    _, store = wired(backend)

    erased = await store.erase_user(MALLORY)

    assert erased.legacy_turns == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-x"]
    assert [m.content for m in await store.transcript("conv-x", user_id=VICTIM)] == ["mine"]


async def test_erasing_a_user_takes_their_turns_under_an_object_id(backend: Backend) -> None:
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "lt-object", "conversation_id": {"tenant": "t-1", "n": 7}, "user_id": MALLORY,
         "user_message": "«UNDER AN OBJECT»"}
    )  # fmt: skip
    _, store = wired(backend)

    erased = await store.erase_user(MALLORY)

    assert erased.legacy_turns == 1
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


async def _a_migrated_prompt(backend: Backend, legacy_id: str = "conv-h") -> str:
    """A migrated conversation whose legacy turn raised the prompt r-1, pending in
    `session_hitl` (naming the legacy id); the id it is stored under."""
    prompt = {"type": "hitl", "action": "pay", "params": {}, "request_id": "r-1"}
    turn = {"_id": "t-1", "conversation_id": legacy_id, "user_id": "u-1",
            "created_at": utc_now(), "user_message": "pay?",
            "response_parts": [prompt]}  # fmt: skip
    await backend.db[SESSION_HITL].insert_many(
        [{"_id": "p-1", "conversation_id": legacy_id, "request_id": "r-1", "action": "pay",
          "status": "pending"},
         {"_id": "p-other", "conversation_id": "conv-other", "request_id": "r-1",
          "action": "pay", "status": "pending"}]
    )  # fmt: skip
    cid = await migrated(backend, [turn])
    prompts = await backend.db[SESSION_HITL].find({"_id": "p-1"}).to_list(None)
    document = with_session_prompts(convert([turn]), prompts).conversation
    assert document is not None
    await backend.db[CONVERSATIONS].replace_one({"_id": cid}, document.model_dump(by_alias=True))
    return cid


@pytest.mark.parametrize("legacy_id", ["conv-h", "conv h/é"],
                         ids=["a legacy id", "a legacy id stored under a derived id"])  # fmt: skip
async def test_with_dual_write_a_resolved_prompt_is_resolved_in_session_hitl_too(
    backend: Backend, legacy_id: str
) -> None:
    """The old service reads its prompts from `session_hitl`: the answer is written there,
    to that prompt alone, so a rollback does not ask it again; and a conversion reading it
    keeps it resolved (`resolved_hitl`), as the document the rollback moves away did."""
    cid = await _a_migrated_prompt(backend, legacy_id)
    _, store = wired(backend, dual_write=True)

    await store.resolve_hitl(cid, "r-1", user_id="u-1")

    answered = await backend.db[SESSION_HITL].find_one({"_id": "p-1"})
    other = await backend.db[SESSION_HITL].find_one({"_id": "p-other"})
    assert answered is not None
    assert other is not None
    assert (answered["status"], answered["resolved"], answered["dual_write"]) == (
        "resolved", True, True)  # fmt: skip
    assert not is_pending_prompt(answered)
    assert is_pending_prompt(other)
    turns = await backend.db[LEGACY_TURNS].find().to_list(None)
    conversion = with_session_prompts(convert(turns), [answered])
    assert conversion.conversation is not None
    assert conversion.conversation.pending_hitl is None
    assert conversion.conversation.resolved_hitl == ["r-1"]


async def test_with_dual_write_an_answer_marks_the_owners_prompt_never_another_users(
    backend: Backend,
) -> None:
    """Another user's `session_hitl` prompt of the same request id is no part of the owner's
    conversation (`owners_prompt`): the owner's answer marks the owner's prompt and those
    naming no user resolved, and leaves the other user's pending, as a delete leaves it."""
    call = {"type": "hitl", "action": "pay", "params": {}, "request_id": "req-1"}
    turn = {"_id": "t-1", "conversation_id": "c-o", "user_id": "u-b",
            "created_at": utc_now(), "user_message": "pay?", "response_parts": [call]}  # fmt: skip
    asked = {"conversation_id": "c-o", "request_id": "req-1", "action": "pay",
             "status": "pending"}  # fmt: skip
    await backend.db[SESSION_HITL].insert_many(
        [asked | {"_id": "p-a", "user_id": "u-a", "params": {"iban": "A-IBAN"}},
         asked | {"_id": "p-b", "user_id": "u-b"},
         asked | {"_id": "p-none"}]
    )  # fmt: skip
    cid = await migrated(backend, [turn])
    prompts = await backend.db[SESSION_HITL].find().to_list(None)
    document = with_session_prompts(convert([turn]), prompts).conversation
    assert document is not None
    await backend.db[CONVERSATIONS].replace_one({"_id": cid}, document.model_dump(by_alias=True))
    _, store = wired(backend, dual_write=True)

    await store.resolve_hitl(cid, "req-1", user_id="u-b")

    found = await backend.db[SESSION_HITL].find().to_list(None)
    pending = {p["_id"]: is_pending_prompt(p) for p in found}
    assert pending == {"p-a": True, "p-b": False, "p-none": False}
    kept = next(p for p in found if p["_id"] == "p-a")
    assert "dual_write" not in kept


async def test_a_resolution_retried_after_its_dual_write_failed_writes_it(
    backend: Backend,
) -> None:
    """The answer recorded, its dual write lost (the database gone meanwhile): the retry,
    answered as the first, writes the dual write."""
    cid = await _a_migrated_prompt(backend)
    await ConversationStore(backend.db).resolve_hitl(cid, "r-1")  # no legacy: no dual write
    assert is_pending_prompt(await backend.db[SESSION_HITL].find_one({"_id": "p-1"}) or {})

    _, store = wired(backend, dual_write=True)
    await store.resolve_hitl(cid, "r-1")

    assert not is_pending_prompt(await backend.db[SESSION_HITL].find_one({"_id": "p-1"}) or {})


async def test_without_dual_write_a_resolution_leaves_session_hitl_as_it_is(
    backend: Backend,
) -> None:
    cid = await _a_migrated_prompt(backend)
    _, store = wired(backend)

    await store.resolve_hitl(cid, "r-1")

    assert is_pending_prompt(await backend.db[SESSION_HITL].find_one({"_id": "p-1"}) or {})


def test_a_prompt_the_old_service_resolved_is_not_remembered_as_the_new_services() -> None:
    """Only the dual write's mark says the new service answered a prompt: one the old
    service resolved converts as it always did (not pending, not in `resolved_hitl`)."""
    turn = {"_id": "t-1", "conversation_id": "c", "created_at": utc_now(), "user_message": "?"}
    prompts = [{"conversation_id": "c", "request_id": "r-old", "status": "done"},
               {"conversation_id": "c", "request_id": "r-new", "status": "resolved",
                "resolved": True, "dual_write": True}]  # fmt: skip
    conversation = with_session_prompts(convert([turn]), prompts).conversation
    assert conversation is not None
    assert (conversation.pending_hitl, conversation.resolved_hitl) == (None, ["r-new"])


@pytest.mark.wire
async def test_a_resolutions_dual_write_costs_three_more_round_trips(wire_backend: Backend) -> None:
    """The conversation's owner (`owners_prompt` takes the prompts of its part only), its
    prompts of the request id, the mark on the owner's."""
    assert wire_backend.commands is not None
    cid = await _a_migrated_prompt(wire_backend)
    _, store = wired(wire_backend, dual_write=True)
    wire_backend.commands.clear()

    await store.resolve_hitl(cid, "r-1")

    assert wire_backend.commands.names == ["find", "update", "find", "find", "update"]


# -- every write that adds messages is dual-written ---------------------------------------


async def _three_turns(logger: AgentMessageLogger, cid: str) -> None:
    for n in range(3):
        await logger.log_messages(
            cid,
            [{"role": "user", "content": f"«Q{n}»"}, {"role": "assistant", "content": f"«A{n}»"}],
            user_id="u-1",
            turn_id=f"t-{n}",
        )


async def test_a_fork_is_dual_written_as_the_legacy_turns_its_copies_came_from(
    backend: Backend,
) -> None:
    """After a rollback the old service reads a fork made during the transition whole: its
    copies are legacy turns too, one per turn of the original, which convert back to them."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    await _three_turns(logger, "c-1")
    for _ in range(2):  # the same fork retried rewrites the same legacy turns
        await logger.fork("c-1", 3, "f-1", user_id="u-1")

    copies = await backend.db[LEGACY_TURNS].find({"conversation_id": "f-1"}).to_list(None)
    converted = convert(copies)
    forked = await ConversationStore(backend.db).transcript("f-1")

    assert [(c["user_message"], c["response_text"]) for c in copies] == [
        ("«Q0»", "«A0»"),
        ("«Q1»", "«A1»"),
    ]
    assert all(c["dual_write"] and c["user_id"] == "u-1" for c in copies)
    assert converted.problems == []
    assert visible(converted.messages) == visible(forked)


async def test_a_steering_delivery_is_dual_written(backend: Backend) -> None:
    """A message delivered into a running turn is a turn of its own, stored: the old service
    finds it after a rollback as it finds every other turn."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    await _three_turns(logger, "c-1")
    inbox = SteeringInbox(logger)
    await inbox.open_turn("c-1", "t-3", user_id="u-1")

    delivered = await inbox.try_deliver(
        "c-1", "t-3", {"role": "user", "content": "«STEER»"}, delivery_id="d-1"
    )

    copies = await backend.db[LEGACY_TURNS].find({"conversation_id": "c-1"}).to_list(None)
    assert delivered
    assert [m.content for m in convert(copies).messages if m.role == "user"] == [
        "«Q0»",
        "«Q1»",
        "«Q2»",
        "«STEER»",
    ]


SAME_ID_TWO_WAYS = [pytest.param(42, "42", id="a-number-and-its-text"), ("conv-m", "conv-m")]


async def two_users_legacy_turns(
    backend: Backend, victims_id: Any, owners_id: Any, victim: Any = VICTIM
) -> None:
    """The victim's legacy turn, then, a day later, Mallory's under an id read alike: Mallory
    is the last user the turns name, so the conversation's owner (`owner_of`)."""
    day = datetime(2025, 1, 1, tzinfo=UTC)
    await backend.db[LEGACY_TURNS].insert_many(
        [{"_id": "lt-victim", "conversation_id": victims_id, "user_id": victim, "created_at": day,
          "user_message": "victim's words", "response_parts": [{"type": "text", "content": "ok"}]},
         {"_id": "lt-mallory", "conversation_id": owners_id, "user_id": MALLORY,
          "created_at": day + timedelta(days=1), "user_message": "hers",
          "response_parts": [{"type": "text", "content": "hi"}]}]
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-victim", "conversation_id": victims_id, "user_id": victim,
         "request_id": "r-victim", "action": "confirm", "status": "pending"}
    )  # fmt: skip


@pytest.mark.parametrize(("victims_id", "owners_id"), SAME_ID_TWO_WAYS)
async def test_the_owner_of_a_legacy_conversation_reads_none_of_another_users_turns(
    backend: Backend, victims_id: Any, owners_id: Any
) -> None:
    """Legacy turns are owned by the user they name: before any migration, the fallback
    serves its owner the turns naming them (or no one), never another user's words."""
    await two_users_legacy_turns(backend, victims_id, owners_id)
    _, store = wired(backend)

    transcript = await store.transcript(str(owners_id), user_id=MALLORY)
    conversation = await store.get_conversation(str(owners_id), user_id=MALLORY)

    assert [m.content for m in transcript] == ["hers", "hi"]
    assert conversation.pending_hitl is None
    assert conversation.message_count == 2
    assert len(await store.transcript(str(owners_id))) == 4  # a service reads every turn


@pytest.mark.parametrize(("victims_id", "owners_id"), SAME_ID_TWO_WAYS)
async def test_the_owners_delete_of_a_legacy_conversation_leaves_another_users_turns(
    backend: Backend, victims_id: Any, owners_id: Any
) -> None:
    await two_users_legacy_turns(backend, victims_id, owners_id)
    _, store = wired(backend)

    deleted = await store.delete(str(owners_id), user_id=MALLORY)

    assert deleted.legacy_turns == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-victim"]
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-victim"]


async def test_erasing_the_owner_of_a_legacy_conversation_leaves_another_users_turns(
    backend: Backend,
) -> None:
    await two_users_legacy_turns(backend, "conv-m", "conv-m")
    _, store = wired(backend)

    await store.erase_user(MALLORY)

    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-victim"]
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-victim"]


NO_TOKENS_USERS = pytest.mark.parametrize(
    "victim",
    [
        pytest.param("alice+work@example.com", id="an-email-with-a-plus"),
        pytest.param("tenant/alice", id="a-path"),
        pytest.param(4.2e20, id="a-double-written-4.2e+20"),
        pytest.param(["alice"], id="an-array-of-an-identifier"),
        pytest.param([None], id="an-array-holding-null"),
        pytest.param("alice\n", id="an-identifier-and-a-line-break"),
    ],
)
"""Legacy user ids no token can be (no identifier), each a user all the same: the one the
migration stores it as (`derived_user_id`, of its text: `str()`). An array is no identifier
whatever it holds (a query matches one by its elements), nor text ending in a line break (a
server's `$` matches before one)."""


@NO_TOKENS_USERS
async def test_the_owner_of_a_legacy_conversation_reads_none_of_a_user_no_token_can_be(
    backend: Backend, victim: Any
) -> None:
    """Only a missing, null or blank `user_id` names no user: a turn or prompt naming a user
    whose id is no identifier is that user's, never the owner's part."""
    await two_users_legacy_turns(backend, "conv-m", "conv-m", victim)
    _, store = wired(backend)

    transcript = await store.transcript("conv-m", user_id=MALLORY)
    conversation = await store.get_conversation("conv-m", user_id=MALLORY)

    assert [m.content for m in transcript] == ["hers", "hi"]
    assert conversation.pending_hitl is None
    assert await store.pending_hitl("conv-m", user_id=MALLORY) is None
    assert conversation.message_count == 2


@NO_TOKENS_USERS
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_the_owners_delete_or_erasure_leaves_the_legacy_turns_of_a_user_no_token_can_be(
    backend: Backend, victim: Any, how: str
) -> None:
    await two_users_legacy_turns(backend, "conv-m", "conv-m", victim)
    _, store = wired(backend)

    if how == "erase the user":
        deleted = (await store.erase_user(MALLORY)).legacy_turns
    else:
        deleted = (await store.delete("conv-m", user_id=MALLORY)).legacy_turns

    assert deleted == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-victim"]
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-victim"]


@NO_TOKENS_USERS
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_a_legacy_conversation_a_user_no_token_can_be_owns_is_the_derived_users_part(
    backend: Backend, victim: Any, how: str
) -> None:
    """Mallory's turn, then the victim's: the victim owns it as the user the migration stores
    them as (`derived_user_id`), whose token alone reads their part; that user's delete or
    erasure takes it, prompt too. Mallory's token gets 404, and her turn stays."""
    await two_users_legacy_turns(backend, "conv-m", "conv-m", victim)
    await backend.db[LEGACY_TURNS].update_one(  # Mallory's turn is the older one now
        {"_id": "lt-mallory"}, {"$set": {"created_at": datetime(2024, 12, 1, tzinfo=UTC)}}
    )
    _, store = wired(backend)
    owner = derived_user_id(str(victim))

    said = [m.content for m in await store.transcript("conv-m", user_id=owner)]
    pending = await store.pending_hitl("conv-m", user_id=owner)
    with pytest.raises(NotFound):
        await store.transcript("conv-m", user_id=MALLORY)
    if how == "erase the user":
        deleted = await store.erase_user(owner)
    else:
        deleted = await store.delete("conv-m", user_id=owner)

    assert said == ["victim's words", "ok"]
    assert pending is not None
    assert pending.request_id == "r-victim"
    assert deleted.legacy_turns == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["lt-mallory"]
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


@NO_TOKENS_USERS
async def test_a_claim_of_the_derived_user_moves_the_legacy_turns_and_prompts_naming_it(
    backend: Backend, victim: Any
) -> None:
    """`claim` maps the user the migration derives for an id that is no identifier to the
    real one: the legacy turns and prompts naming that id move too, Mallory's stay."""
    await two_users_legacy_turns(backend, "conv-m", "conv-m", victim)
    _, store = wired(backend)

    await store.claim(derived_user_id(str(victim)), "user-alice")

    users = {t["_id"]: t["user_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)}
    assert users == {"lt-victim": "user-alice", "lt-mallory": MALLORY}
    [prompt] = await backend.db[SESSION_HITL].find().to_list(None)
    assert prompt["user_id"] == "user-alice"


@pytest.mark.parametrize(
    "nobody",
    [None, "", "   ", "\u00a0", "\u3000 \t", "\x1f", "\u2028\n"],
    ids=["null", "empty", "blank", "no-break-space", "ideographic-space", "unit-separator",
         "line-separators"],
)  # fmt: skip
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_a_legacy_turn_naming_no_user_is_the_owners_part(
    backend: Backend, nobody: Any, how: str
) -> None:
    """A missing, null or blank `user_id` names no user, blank as Python's `str.strip()`
    tells it (any Unicode white space): the owner reads, deletes and erases such a turn and
    prompt as their own."""
    await two_users_legacy_turns(backend, "conv-m", "conv-m", nobody)
    _, store = wired(backend)

    said = [m.content for m in await store.transcript("conv-m", user_id=MALLORY)]
    pending = await store.pending_hitl("conv-m", user_id=MALLORY)
    if how == "erase the user":
        erased = await store.erase_user(MALLORY)
    else:
        erased = await store.delete("conv-m", user_id=MALLORY)

    assert said == ["victim's words", "ok", "hers", "hi"]
    assert pending is not None
    assert pending.request_id == "r-victim"
    assert erased.legacy_turns == 2
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


ALICE, BOB = "user-alice", "user-bob"
ALIKE_IDS = [
    pytest.param(42, "42", id="a-number-and-its-text"),
    pytest.param(
        bson.ObjectId("65e1a0000000000000000001"),
        "65e1a0000000000000000001",
        id="an-object-id-and-its-hex",
    ),
]


async def alice_then_bob_under_ids_read_alike(backend: Backend, stored: Any, text: str) -> None:
    """One legacy conversation filed under two ids read alike, a minute apart: Alice's turn A
    under `stored`, Bob's B under its `text`, then C under `stored` naming no user. Bob is the
    last user named, so owns it (`owner_of`), and C is his part (`users_part`), as is the
    prompt p-owner under `stored` naming no user; p-alice names Alice."""
    at = datetime(2025, 3, 1, 10, tzinfo=UTC)
    await backend.db[LEGACY_TURNS].insert_many(
        [{"_id": name, "conversation_id": cid, "user_id": user,
          "created_at": at + timedelta(minutes=n), "user_message": f"«{name}»",
          "response_parts": [{"type": "text", "content": f"ok {name}"}]}
         for n, (name, cid, user) in enumerate(
             [("A", stored, ALICE), ("B", text, BOB), ("C", stored, None)])]
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_many(
        [{"_id": "p-alice", "conversation_id": stored, "user_id": ALICE, "request_id": "r-a",
          "action": "confirm", "status": "done"},
         {"_id": "p-owner", "conversation_id": stored, "request_id": "r-o",
          "action": "confirm", "status": "done"}]
    )  # fmt: skip


async def _said(store: ConversationStore, cid: str, user: str) -> list[Any]:
    return [m.content for m in await store.transcript(cid, user_id=user) if m.role == "user"]


@pytest.mark.parametrize(("stored", "text"), ALIKE_IDS)
async def test_erasing_a_user_leaves_the_owners_part_of_a_conversation_under_ids_read_alike(
    backend: Backend, stored: Any, text: str
) -> None:
    """Alice owns no conversation: her erasure takes the turn and prompt naming her, never
    Bob's part of the conversation her turn is filed in, whichever of its ids it names."""
    await alice_then_bob_under_ids_read_alike(backend, stored, text)
    _, store = wired(backend)

    erased = await store.erase_user(ALICE)

    assert erased.legacy_turns == 1
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["B", "C"]
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-owner"]
    assert await _said(store, text, BOB) == ["«B»", "«C»"]


@pytest.mark.parametrize(("stored", "text"), ALIKE_IDS)
async def test_erasing_the_owner_of_a_conversation_under_ids_read_alike_takes_their_whole_part(
    backend: Backend, stored: Any, text: str
) -> None:
    """Bob owns the conversation as the reader names it: his erasure takes his part of it,
    the turn naming no user filed under the other id too, and leaves Alice's turn, which
    her token then reads alone."""
    await alice_then_bob_under_ids_read_alike(backend, stored, text)
    _, store = wired(backend)

    erased = await store.erase_user(BOB)

    assert erased.legacy_turns == 2
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["A"]
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-alice"]
    assert await _said(store, text, ALICE) == ["«A»"]


OBJECT_ID = bson.ObjectId("64b000000000000000000042")
NAMED_BY_ANY_VALUE = pytest.mark.parametrize(
    ("named_as", "user"),
    [
        (42, "42"),
        (bson.Int64(42), "42"),
        (42.0, "42.0"),
        (42.5, "42.5"),
        (True, "True"),
        (bson.Decimal128("42.5"), "42.5"),
        (bson.Code("u1"), "u1"),
        (OBJECT_ID, str(OBJECT_ID)),
    ],
    ids=["int32", "int64", "double", "fraction", "bool", "decimal128", "code", "object-id"],
)
"""Values the old service may have stored as `user_id`, each read as the user its text is."""


LETTERED_ID = bson.ObjectId("6b0d2c1e9f1a4b3c2d1e0f1a")
"""An ObjectId whose hex holds letters in both halves."""


@pytest.mark.parametrize(
    "spelling",
    [str.upper, lambda hex_: hex_[:12] + hex_[12:].upper()],
    ids=["upper-case", "mixed-case"],
)
async def test_a_conversation_filed_under_an_object_id_answers_only_to_its_lowercase_hex(
    backend: Backend, spelling: Any
) -> None:
    """Ids are case-sensitive and the migration names the conversation by `str(ObjectId)`:
    another spelling of its hex is another conversation, one the owner may start, and
    neither reads nor deletes the legacy one."""
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "lt-oid", "conversation_id": LETTERED_ID, "user_id": BOB,
         "created_at": datetime(2025, 1, 1, tzinfo=UTC),
         "user_message": "grace legacy words", "response_text": "ok"}
    )  # fmt: skip
    logger, store = wired(backend)
    other = spelling(str(LETTERED_ID))

    with pytest.raises(NotFound):
        await store.transcript(other, user_id=BOB)
    with pytest.raises(NotFound):
        await store.delete(other, user_id=BOB)
    await logger.log_messages(other, [{"role": "user", "content": "new"}], user_id=BOB)

    assert await _said(store, other, BOB) == ["new"]
    assert await _said(store, str(LETTERED_ID), BOB) == ["grace legacy words"]
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 1


async def legacy_turn_naming(backend: Backend, named_as: Any) -> None:
    """A legacy turn and its prompt naming a user by a value that is not text, as the old
    service may have written it."""
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "lt-42", "conversation_id": "conv-n", "user_id": named_as,
         "user_message": "my medical history",
         "response_parts": [{"type": "text", "content": "ok"}]}
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-42", "conversation_id": "conv-n", "user_id": named_as, "request_id": "r-1",
         "action": "confirm", "status": "pending"}
    )  # fmt: skip


@NAMED_BY_ANY_VALUE
async def test_a_user_named_by_any_value_is_erased_from_the_legacy_turns_its_token_reads(
    backend: Backend, named_as: Any, user: str
) -> None:
    await legacy_turn_naming(backend, named_as)
    _, store = wired(backend)
    read = await store.transcript("conv-n", user_id=user)
    assert [m.content for m in read] == ["my medical history", "ok"]

    await store.erase_user(user)

    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0
    assert await backend.db[SESSION_HITL].count_documents({}) == 0
    with pytest.raises(NotFound):
        await store.transcript("conv-n", user_id=user)


@NAMED_BY_ANY_VALUE
async def test_a_user_named_by_any_value_deletes_its_legacy_conversation_with_its_prompt(
    backend: Backend, named_as: Any, user: str
) -> None:
    await legacy_turn_naming(backend, named_as)
    _, store = wired(backend)

    deleted = await store.delete("conv-n", user_id=user)

    assert deleted.legacy_turns == 1
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


@NAMED_BY_ANY_VALUE
async def test_a_claim_moves_the_legacy_turns_and_prompts_naming_the_user_by_any_value(
    backend: Backend, named_as: Any, user: str
) -> None:
    await legacy_turn_naming(backend, named_as)
    _, store = wired(backend)

    claimed = await store.claim(user, "user-claimed")

    assert claimed.legacy_turns == 1
    read = await store.transcript("conv-n", user_id="user-claimed")
    assert [m.content for m in read] == ["my medical history", "ok"]
    with pytest.raises(NotFound):
        await store.transcript("conv-n", user_id=user)


def said_in_order(messages: list[AgentMessage]) -> list[tuple[object, ...]]:
    """What messages say, in order, one entry per thing said: what the legacy format holds of
    a message (an assistant's text beside its calls comes back as a message of its own, a
    result without content as an empty one)."""
    found: list[tuple[object, ...]] = []
    for m in messages:
        if m.role == "tool":
            found.append(("tool", m.tool_call_id, m.content or ""))
            continue
        if m.content and m.hitl_action is None:
            found.append((m.role, "content", m.content))
        if m.upload is not None:
            found.append((m.role, "upload", m.upload))
        found += [(m.role, "call", c.id, c.function.name, c.function.arguments)
                  for c in m.tool_calls or ()]  # fmt: skip
        if m.hitl_action is not None:
            prompt = m.hitl_action
            found.append((m.role, "hitl", m.content, prompt.action, prompt.params))
        if m.error is not None:
            found.append((m.role, "error", m.error.message))
    return found


@pytest.mark.parametrize("shape", TURN_SHAPES.values(), ids=list(TURN_SHAPES))
async def test_a_dual_written_turn_converts_back_to_what_its_messages_say_in_order(
    backend: Backend, shape: list[dict[str, Any]]
) -> None:
    """MIGRATION.md, transition flags: the copy converts back to the same messages, in order,
    whatever shape a turn's messages have; the old gate reads it as its messages."""
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    await logger.log_messages("conv-shape", shape, turn_id="t-1")

    documents = await backend.db[LEGACY_TURNS].find().to_list(None)
    stored = await ConversationStore(backend.db).transcript("conv-shape")
    converted = convert(documents)

    assert converted.problems == []
    assert said_in_order(converted.messages) == said_in_order(stored)
    assert differences(from_legacy(parse_turns(documents)), from_messages(stored)) == []


async def test_a_dual_written_native_item_is_kept_where_the_migration_counts_it(
    backend: Backend,
) -> None:
    """A runtime's own item (`native`) has no legacy part: the copy keeps it in a field the
    converter reports as content no message holds, never dropped unseen."""
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    await logger.log_messages(
        "conv-native",
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "native": NATIVE_FORM},
         {"role": "assistant", "content": "hello"}],
        turn_id="t-1",
    )  # fmt: skip

    documents = await backend.db[LEGACY_TURNS].find().to_list(None)
    converted = convert(documents)

    assert [(m.role, m.content) for m in converted.messages] == [
        ("user", "hi"), ("assistant", "hello")
    ]  # fmt: skip
    assert [(p.kind, p.field, p.placed) for p in converted.problems] == [
        ("unread_field", "native", False)
    ]
    assert "«REASONING»" in str(converted.problems[0].content)


# -- a live conversation's dual-written copies are its own ------------------------------

LIVE_HOLDERS = pytest.mark.parametrize(
    "holder", [VICTIM, None], ids=["assigned to the victim", "unowned"]
)
LATE = pytest.mark.parametrize("late", ["after its copies", "before its copies"])


async def live_beside_a_late_legacy_turn(
    backend: Backend, holder: str | None, late: str = "after its copies"
) -> tuple[ConversationStore, set[Any]]:
    """Dual write on: a service logs `conv-x` unowned (its copy names no user), then, for
    `holder`, a turn naming them assigns it to them; the old service writes a legacy turn
    naming Mallory under `conv-x`, dated after the copies or before them. The store, and
    the `_id`s of the live conversation's copies."""
    logger, store = wired(backend, dual_write=True)
    await logger.log_messages("conv-x", [{"role": "user", "content": "«EARLY SECRET»"}],
                              turn_id="s0")  # fmt: skip
    await logger.log_messages("conv-x", [{"role": "user", "content": "«LATER SECRET»"}],
                              user_id=holder, turn_id="s1")  # fmt: skip
    copies = {c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)}
    shift = timedelta(minutes=1 if late == "after its copies" else -10)
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "late-mallory", "conversation_id": "conv-x", "user_id": MALLORY,
         "created_at": utc_now() + shift, "user_message": "hers",
         "response_parts": [{"type": "text", "content": "ok"}]}
    )  # fmt: skip
    return store, copies


@LIVE_HOLDERS
@LATE
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_a_live_conversations_copies_are_never_another_users_legacy_turns(
    backend: Backend, holder: str | None, late: str, how: str
) -> None:
    """The rollback copies of a live conversation are its own, its owner's (or no user's,
    unowned), whatever a legacy turn under its id names: to Mallory, whose late legacy turn
    is there, the conversation is as if absent, so her token reads her turn alone, and her
    delete or erasure takes it alone."""
    store, copies = await live_beside_a_late_legacy_turn(backend, holder, late)

    said = [m.content for m in await store.transcript("conv-x", user_id=MALLORY)]
    served = await store.get_conversation("conv-x", user_id=MALLORY)
    if how == "erase the user":
        erased = await store.erase_user(MALLORY)
    else:
        erased = await store.delete("conv-x", user_id=MALLORY)

    assert said == ["hers", "ok"]
    assert (served.user_id, served.message_count) == (MALLORY, 2)
    assert erased.legacy_turns == 1
    left = {c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)}
    assert left == copies
    live = [m.content for m in await store.transcript("conv-x", user_id=holder)]
    assert live == ["«EARLY SECRET»", "«LATER SECRET»"]


@LATE
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_the_live_owners_delete_or_erasure_takes_every_copy_of_her_conversation(
    backend: Backend, late: str, how: str
) -> None:
    """Her conversation's copies go with it, those naming no user (logged before a turn
    assigned it to her) too, whatever a late legacy turn under its id names; Mallory's legacy
    turn stays, and her token reads it alone."""
    store, copies = await live_beside_a_late_legacy_turn(backend, VICTIM, late)

    if how == "erase the user":
        await store.erase_user(VICTIM)
    else:
        await store.delete("conv-x", user_id=VICTIM)

    left = [c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)]
    assert left == ["late-mallory"]
    assert copies
    said = [m.content for m in await store.transcript("conv-x", user_id=MALLORY)]
    assert said == ["hers", "ok"]


@LIVE_HOLDERS
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_a_legacy_turn_naming_no_user_beside_a_live_conversation_is_its_owners_alone(
    backend: Backend, holder: str | None, how: str
) -> None:
    """Beside a live conversation's copies, a legacy turn (and a prompt) naming no user, no
    copy, belongs with the live conversation, whoever a late legacy turn under its id names
    last: Mallory's token reads her own turn alone, her delete or erasure takes it alone, and
    the live conversation's delete takes the turn and the prompt naming no user."""
    store, copies = await live_beside_a_late_legacy_turn(backend, holder)
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "legacy-none", "conversation_id": "conv-x", "user_id": None,
         "created_at": utc_now() + timedelta(minutes=5), "user_message": "«UNOWNED SECRET»",
         "response_parts": [{"type": "text", "content": "noted"}]}
    )  # fmt: skip
    await backend.db[SESSION_HITL].insert_one(
        {"_id": "p-none", "conversation_id": "conv-x", "request_id": "r-1", "action": "pay",
         "prompt": "«UNOWNED PROMPT»", "status": "pending"}
    )  # fmt: skip

    said = [m.content for m in await store.transcript("conv-x", user_id=MALLORY)]
    if how == "erase the user":
        erased = await store.erase_user(MALLORY)
    else:
        erased = await store.delete("conv-x", user_id=MALLORY)

    assert said == ["hers", "ok"]
    assert erased.legacy_turns == 1
    left = {c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)}
    assert left == copies | {"legacy-none"}
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-none"]
    deleted = await store.delete("conv-x", user_id=holder)
    assert deleted.legacy_turns == len(copies) + 1
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


@LIVE_HOLDERS
async def test_another_users_delete_leaves_the_late_legacy_turn_naming_no_user_beside_it(
    backend: Backend, holder: str | None
) -> None:
    """A late legacy turn naming no user, not moved aside yet, beside a live conversation is
    its owner's part, as one moved aside is: Mallory's delete of the id, which takes her own
    turn, leaves it; the live conversation's delete takes it."""
    store, _ = await live_beside_a_late_legacy_turn(backend, holder)
    late = late_legacy_turn("late-none", None, "conv-x")
    await backend.db[CONVERSATIONS].insert_one(late)

    erased = await store.delete("conv-x", user_id=MALLORY)

    assert erased.legacy_turns == 1
    assert await backend.db[CONVERSATIONS].find_one({"_id": "late-none"}) is not None
    await store.delete("conv-x", user_id=holder)
    assert await backend.db[CONVERSATIONS].find_one({"_id": "late-none"}) is None


DUAL_WRITE = pytest.mark.parametrize("dual_write", [True, False], ids=["dual write on", "off"])


async def live_beside_unnamed_legacy_documents(
    backend: Backend, holder: str | None, dual_write: bool
) -> tuple[ConversationStore, set[Any]]:
    """`holder`'s live conversation `conv-x`, dual write on or off, and under its id, as an
    old-service writer leaves them: a legacy turn and prompts (one naming the conversation,
    one naming it by `session_id` only) naming no user, then Mallory's late legacy turn, the
    last naming a user. The store, and the `_id`s of the live conversation's copies (none
    with dual write off)."""
    logger, store = wired(backend, dual_write=dual_write)
    await logger.log_messages("conv-x", [{"role": "user", "content": "«LIVE SECRET»"}],
                              user_id=holder, turn_id="s0")  # fmt: skip
    copies = {c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)}
    for turn_id, user, minutes in (("legacy-none", None, 1), ("late-mallory", MALLORY, 5)):
        said = "hers" if user else "«UNOWNED SECRET»"
        await backend.db[LEGACY_TURNS].insert_one(
            {"_id": turn_id, "conversation_id": "conv-x", "user_id": user,
             "created_at": utc_now() + timedelta(minutes=minutes), "user_message": said,
             "response_parts": [{"type": "text", "content": "ok"}]}
        )  # fmt: skip
    for key in ("conversation_id", "session_id"):
        await backend.db[SESSION_HITL].insert_one(
            {"_id": f"p-{key}", key: "conv-x", "request_id": f"r-{key}", "action": "pay",
             "prompt": "«UNOWNED PROMPT»", "status": "pending",
             "created_at": utc_now() + timedelta(minutes=2)}
        )  # fmt: skip
    return store, copies


@DUAL_WRITE
@LIVE_HOLDERS
@pytest.mark.parametrize("how", ["delete the conversation", "erase the user"])
async def test_what_names_no_user_beside_a_live_conversation_is_its_owners_whatever_dual_write(
    backend: Backend, dual_write: bool, holder: str | None, how: str
) -> None:
    """A legacy turn and prompts naming no user under a live conversation's id are its
    owner's (no user's, unowned), dual write on or off, however late a legacy turn naming
    Mallory is: her token reads her turn alone, no prompt, and her delete or erasure takes
    her turn alone; the live conversation's delete takes the turn and prompts naming no user
    (was, dual write off: Mallory, the last user named, read them and her delete took them)."""
    store, copies = await live_beside_unnamed_legacy_documents(backend, holder, dual_write)

    said = [m.content for m in await store.transcript("conv-x", user_id=MALLORY)]
    pending = await store.pending_hitl("conv-x", user_id=MALLORY)
    if how == "erase the user":
        erased = await store.erase_user(MALLORY)
    else:
        erased = await store.delete("conv-x", user_id=MALLORY)

    assert (said, pending) == (["hers", "ok"], None)
    assert erased.legacy_turns == 1
    left = {c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)}
    assert left == copies | {"legacy-none"}
    prompts = {p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)}
    assert prompts == {"p-conversation_id", "p-session_id"}
    deleted = await store.delete("conv-x", user_id=holder)
    assert deleted.legacy_turns == len(copies) + 1
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0
    assert await backend.db[SESSION_HITL].count_documents({}) == 0


@DUAL_WRITE
async def test_the_live_owners_erasure_takes_what_names_no_user_beside_her_conversation(
    backend: Backend, dual_write: bool
) -> None:
    """Her erasure takes the legacy turn and prompts naming no user under her live
    conversation's id with it, dual write on or off (was, off: none named her there, so they
    stayed, and once her conversation went they were Mallory's, the last user named); the
    late legacy turn naming Mallory stays, hers alone."""
    store, copies = await live_beside_unnamed_legacy_documents(backend, VICTIM, dual_write)

    erased = await store.erase_user(VICTIM)

    assert erased.legacy_turns == len(copies) + 1
    left = [c["_id"] for c in await backend.db[LEGACY_TURNS].find().to_list(None)]
    assert left == ["late-mallory"]
    assert await backend.db[SESSION_HITL].count_documents({}) == 0
    said = [m.content for m in await store.transcript("conv-x", user_id=MALLORY)]
    assert said == ["hers", "ok"]


async def test_a_rename_naming_another_version_of_an_unmigrated_conversation_is_refused(
    backend: Backend,
) -> None:
    """A rename naming a version (`If-Match`) is checked as a delete checks it, before the
    refusal of a write to legacy turns: another version is `VersionMismatch`, its own is
    refused as not migrated yet; nothing renamed either way."""
    await backend.db[LEGACY_TURNS].insert_many(example_legacy_turns())
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    version = (await store.get_conversation(EXAMPLE_CONVERSATION_ID)).version

    with pytest.raises(VersionMismatch):
        await store.rename(EXAMPLE_CONVERSATION_ID, "New name", version="0" * 32)
    with pytest.raises(VersionMismatch):
        await store.rename(EXAMPLE_CONVERSATION_ID, "New name", version="0" * 32,
                           user_id=EXAMPLE_USER_ID)  # fmt: skip
    with pytest.raises(Conflict, match="not migrated yet; it can be renamed once"):
        await store.rename(EXAMPLE_CONVERSATION_ID, "New name", version=version)
    with pytest.raises(NotFound):
        await store.rename(EXAMPLE_CONVERSATION_ID, "New name", version="0" * 32,
                           user_id="someone-else")  # fmt: skip
    assert (await store.get_conversation(EXAMPLE_CONVERSATION_ID)).name != "New name"


def _big_turn(where: str, size: int) -> list[dict[str, Any]]:
    """A turn whose messages each fit their bound but whose legacy copy holds `size` bytes of
    a call's arguments (held twice: its part and `tool_calls`) or of three tool results."""
    if where == "arguments":
        arguments = '{"a": "' + "y" * size + '"}'
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "save", "arguments": arguments},
        }
        return [{"role": "user", "content": "save"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    turn: list[dict[str, Any]] = [{"role": "user", "content": "read"}]
    for i in range(3):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        turn.append({"role": "assistant", "content": None, "tool_calls": [call]})
        turn.append({"role": "tool", "tool_call_id": f"c{i}", "content": "z" * (size // 2)})
    return turn


@pytest.mark.parametrize("where", ["arguments", "results"])
async def test_the_legacy_copy_of_a_stored_turn_is_cut_further_until_it_fits_a_document(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Cut documents past the limit are cut further, marked as the store marks cuts: the copy
    is written, the turn is never refused once stored, and a retry is a replay."""
    from agent_store.legacy import _source

    monkeypatch.setattr(_source, "MAX_LEGACY_DOCUMENT_BYTES", 30_000)
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    turn = _big_turn(where, 20_000)

    first = await logger.log_messages("conv-big", turn, turn_id="t")
    again = await logger.log_messages("conv-big", turn, turn_id="t")

    (document,) = await backend.db[LEGACY_TURNS].find().to_list(None)
    assert len(bson.encode(document)) <= 30_000
    assert again.replayed
    assert not first.replayed
    parts = document["response_parts"]
    if where == "arguments":
        calls = [p["args"] for p in parts if p["type"] == "tool_call"]
        cut = [json.loads(args)["truncated_arguments"] for args in calls]
    else:
        cut = [p["result"] for p in parts if p["type"] == "tool_result"]
    assert cut
    assert all(text.endswith(TRUNCATION_MARK) for text in cut)
    assert convert([document]).problems[0].kind == "dual_write_not_exact"


async def test_a_legacy_copy_cut_to_fit_names_only_whole_texts_kept_and_says_what_it_cut(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Texts cut only to fit the copy are kept whole nowhere but in `agent_messages`: the copy
    names no GridFS file for them (none was written), records each cut text (the message's
    `seq`, its path, its whole length and SHA-256) and keeps the `native` forms that fit."""
    from agent_store.legacy import _source

    monkeypatch.setattr(_source, "MAX_LEGACY_DOCUMENT_BYTES", 30_000)
    logger = AgentMessageLogger(backend.db, observers=[LegacyTurns(backend.db, dual_write=True)])
    turn = _big_turn("results", 20_000)
    reasoning = {"format": "openai-agents", "set": {"type": "reasoning", "summary": ["r" * 3000]}}
    turn[1]["native"] = reasoning  # more than the bound each message is cut to at first

    await logger.log_messages("conv-big", turn, turn_id="t")

    (document,) = await backend.db[LEGACY_TURNS].find().to_list(None)
    stored = await ConversationStore(backend.db).transcript("conv-big")
    assert len(bson.encode(document)) <= 30_000
    assert await backend.db[f"{BLOB_BUCKET}.files"].count_documents({}) == 0
    assert "dual_write_whole_texts" not in document
    [native] = [m.native for m in stored if m.native is not None]
    assert native.model_dump()["set"] == reasoning["set"]
    assert document["native"] == [native.model_dump(mode="json")]
    results = [m for m in stored if m.role == "tool"]
    assert document["dual_write_cut"] == [
        {
            "seq": m.seq,
            "path": "content",
            "length": len(m.content or ""),
            "sha256": hashlib.sha256((m.content or "").encode()).hexdigest(),
        }
        for m in results
    ]
    problems = convert([document]).problems
    [problem] = [p for p in problems if p.kind == "dual_write_not_exact"]
    assert "kept whole in GridFS" not in problem.detail
    assert "no file keeps whole" in problem.detail
    assert problem.content["cut"] == document["dual_write_cut"]


async def test_a_turn_at_the_ceiling_bound_has_a_legacy_copy_within_16_mib() -> None:
    """One call of 9 MB of arguments, held twice, on mongomock only (a real 16 MiB scale)."""
    from mongomock_motor import AsyncMongoMockClient

    db = AsyncMongoMockClient(tz_aware=True)["ceiling"]
    rules = TurnRules(max_message_bytes=MAX_MESSAGE_BYTES)
    logger = AgentMessageLogger(db, rules=rules, observers=[LegacyTurns(db, dual_write=True)])

    await logger.log_messages("conv-1", _big_turn("arguments", 9_000_000), turn_id="t1")

    (document,) = await db[LEGACY_TURNS].find().to_list(None)
    assert len(bson.encode(document)) <= 16 * 1024 * 1024
    assert await db[MESSAGES].count_documents({"conversation_id": "conv-1"}) == 2


async def test_a_legacy_copy_refused_as_too_large_is_no_invalid_input_for_the_stored_turn(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn is stored before its copy is written: a refused copy is the store's failure."""
    from pymongo.errors import DocumentTooLarge

    legacy = LegacyTurns(backend.db, dual_write=True)

    async def refused(*_: Any, **__: Any) -> None:
        raise DocumentTooLarge("BSON document too large")

    monkeypatch.setattr(legacy._turns, "replace_one", refused)
    logger = AgentMessageLogger(backend.db, observers=[legacy])

    with pytest.raises(StorageFailure, match="the turn itself is stored"):
        await logger.log_messages("conv-refused", [{"role": "user", "content": "hi"}], turn_id="t")
    assert await backend.db[MESSAGES].count_documents({"conversation_id": "conv-refused"}) == 1


async def test_the_record_of_a_copy_lists_every_legacy_turn_it_was_written_as(
    backend: Backend,
) -> None:
    """A turn of two exchanges is copied as two legacy turns, a fork's turn as one per turn
    of its original: the record of the copy (`COPY_RECORD`) lists each of them, by `_id`,
    with the `seq`s of the messages it holds, so the gate checks every one, not the first
    alone (was: only the first's deletion by the old service was seen)."""
    legacy = LegacyTurns(backend.db, dual_write=True)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    exchanges = [
        {"role": "user", "content": "«A»"},
        {"role": "assistant", "content": "ra"},
        {"role": "user", "content": "«B»"},
        {"role": "assistant", "content": "rb"},
    ]
    await logger.log_messages("c-1", exchanges, user_id="u-1", turn_id="t-1")
    fork = await logger.fork("c-1", 3, "f-1", user_id="u-1")

    for cid, turn_id in (("c-1", "t-1"), ("f-1", fork.turn_id)):
        copies = await backend.db[LEGACY_TURNS].find({"conversation_id": cid}).to_list(None)
        document = await backend.db[CONVERSATIONS].find_one({"_id": cid})
        assert document is not None
        record_id = copy_record_id(cid, turn_id, document.get("epoch"))
        record = await backend.db[MIGRATION_STATE].find_one({"_id": record_id})
        assert record is not None, cid
        pieces = [(legacy_turn_id(cid, turn_id), [0, 1]),
                  (legacy_turn_id(cid, f"{turn_id}\0seq-2"), [2, 3])]  # fmt: skip
        assert sorted(c["_id"] for c in copies) == sorted(p for p, _ in pieces)
        assert record[COPY_PIECES] == [{"_id": p, "seqs": seqs} for p, seqs in pieces]


@pytest.mark.parametrize("dual_write", [True, False], ids=["dual write on", "dual write off"])
async def test_every_write_adding_messages_stores_them_owing_their_copy_while_the_dual_write_is_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, dual_write: bool
) -> None:
    """MIGRATION.md "What `finish` guarantees": while the dual write is on, a turn, a fork's
    copies and a steering delivery are stored marked `copy_owed` by the insert that stores
    them, before any observer runs, so a turn whose first dual write (the record of its copy)
    failed, the runtime never sending it again, still says it owed a copy; never served.
    With the dual write off no message carries the key."""
    legacy = LegacyTurns(backend.db, dual_write=dual_write)
    logger = AgentMessageLogger(backend.db, observers=[legacy], legacy=legacy)
    await _three_turns(logger, "c-1")
    await logger.fork("c-1", 3, "f-1", user_id="u-1")
    inbox = SteeringInbox(logger)
    await inbox.open_turn("c-1", "t-3", user_id="u-1")
    await inbox.try_deliver("c-1", "t-3", {"role": "user", "content": "«STEER»"}, delivery_id="d")
    intend = LegacyTurns._intend_copy

    async def failing(self: LegacyTurns, *args: Any) -> None:
        if self.dual_write:
            raise AutoReconnect("primary stepped down")
        await intend(self, *args)

    monkeypatch.setattr(LegacyTurns, "_intend_copy", failing)
    failed = [{"role": "user", "content": "«LOST»"}, {"role": "assistant", "content": "ok"}]
    if dual_write:
        with pytest.raises(StorageUnavailable):
            await logger.log_messages("c-1", failed, user_id="u-1", turn_id="t-9")
    else:
        await logger.log_messages("c-1", failed, user_id="u-1", turn_id="t-9")

    stored = await backend.db[MESSAGES].find({}).to_list(None)
    assert {d["conversation_id"] for d in stored} == {"c-1", "f-1"}  # the fork's copies
    assert {"t-0", "t-9"} <= {d["turn_id"] for d in stored}
    assert "«STEER»" in [d["content"] for d in stored]  # the delivery
    if dual_write:
        assert all(d.get("copy_owed") is True for d in stored)
    else:
        assert not any("copy_owed" in d for d in stored)
    served = await ConversationStore(backend.db).transcript("c-1")
    assert all("copy_owed" not in m.model_dump(by_alias=True) for m in served)
