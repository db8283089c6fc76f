"""Conversation names: automatic from the first real user text, never over a chosen one."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from agent_store import (
    AgentMessageLogger,
    Conflict,
    ConversationStore,
    InvalidInput,
    StorageUnavailable,
)
from agent_store.core import UserMessage
from agent_store.store import (
    ELLIPSIS,
    HIDDEN_CHARACTERS,
    TurnRules,
    auto_name,
    collapse_whitespace,
)
from agent_store.store._turns import message_id
from app.settings import Settings
from tests.conftest import COUNTED, Backend

CID = "conv-names"

Turn = list[dict[str, Any]]


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def answer(content: str = "Sure.") -> dict[str, Any]:
    return {"role": "assistant", "content": content}


UPLOAD = {"filename": "invoice.pdf", "file_type": "application/pdf", "size": 1024}

UNNAMING_TURNS = [
    pytest.param([{"role": "system", "content": "Daily summary trigger"}, answer()], id="system"),
    pytest.param([{"role": "user", "upload": UPLOAD}], id="upload-only"),
    pytest.param([{"role": "user", "content": "Here it is", "upload": UPLOAD}], id="upload"),
    pytest.param(
        [user("[RUNTIME CONTEXT]user tz=Europe/Paris[/RUNTIME CONTEXT]"), answer()],
        id="runtime-context-only",
    ),
    pytest.param([user("  \n\t ")], id="white-space-only"),
    pytest.param([user("\u200b \u3164\u2060\ufeff")], id="invisible-only"),
    pytest.param([user("\u200f\u200e")], id="direction-marks-only"),
    pytest.param([answer("Welcome back!")], id="assistant-only"),
    pytest.param([{"role": "user", "error": {"message": "upload failed"}}], id="error-only"),
]


async def name_of(backend: Backend) -> tuple[str | None, str | None]:
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    return conversation.name, conversation.name_source


async def test_a_conversation_is_unnamed_until_its_first_user_text(backend: Backend) -> None:
    created = await AgentMessageLogger(backend.db).upsert_conversation(CID, user_id="u1")
    assert (created.name, created.name_source) == (None, None)


async def test_the_first_user_text_names_the_conversation(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(
        CID,
        [
            user("[RUNTIME CONTEXT]tz=UTC; plan=pro[/RUNTIME CONTEXT]  Weather   in\n\tParis? "),
            answer(),
        ],
    )
    assert await name_of(backend) == ("Weather in Paris?", "auto")


async def test_a_long_first_text_is_cut_at_a_word_boundary_with_an_ellipsis(
    backend: Backend,
) -> None:
    text = "Plan a three day trip to Lyon with museums, markets and a cooking class"
    await AgentMessageLogger(backend.db).log_messages(CID, [user(text)])
    name, _ = await name_of(backend)
    assert name == "Plan a three day trip to Lyon with museums, markets and a…"
    assert len(name) <= 60


async def test_the_name_length_is_configurable(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db, rules=TurnRules(name_chars=20))
    await logger.log_messages(CID, [user("Book a table for four tonight at eight")])
    assert await name_of(backend) == ("Book a table for…", "auto")


def test_settings_carry_the_name_length_to_the_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().turn_rules().name_chars == 60
    monkeypatch.setenv("AGENT_STORE_NAME_CHARS", "24")
    assert Settings().turn_rules().name_chars == 24


@pytest.mark.parametrize("bad_length", ["1", "201"])
def test_a_name_length_without_room_for_a_name_is_refused_at_start_up(
    monkeypatch: pytest.MonkeyPatch, bad_length: str
) -> None:
    monkeypatch.setenv("AGENT_STORE_NAME_CHARS", bad_length)
    with pytest.raises(ValidationError, match="name_chars"):
        Settings()


@pytest.mark.parametrize("turn", UNNAMING_TURNS)
async def test_a_turn_without_real_user_text_leaves_the_conversation_unnamed(
    backend: Backend, turn: Turn
) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, turn, turn_id="t1")
    assert await name_of(backend) == (None, None)

    await logger.log_messages(CID, [user("And now a real question"), answer()], turn_id="t2")
    assert await name_of(backend) == ("And now a real question", "auto")


async def test_the_first_real_user_text_of_a_turn_names_it(backend: Backend) -> None:
    await AgentMessageLogger(backend.db).log_messages(
        CID,
        [
            {"role": "system", "content": "Reminder trigger"},
            {"role": "user", "content": "Attached", "upload": UPLOAD},
            user("[RUNTIME CONTEXT]hidden[/RUNTIME CONTEXT]"),
            user("First words"),
            user("Second words"),
        ],
    )
    assert await name_of(backend) == ("First words", "auto")


async def test_later_user_texts_keep_the_automatic_name(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("First question"), answer()], turn_id="t1")
    await logger.log_messages(CID, [user("Second question"), answer()], turn_id="t2")
    assert await name_of(backend) == ("First question", "auto")


async def test_a_name_set_before_the_first_message_is_never_overwritten(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="u1", name="Trip to Lyon")
    await logger.log_messages(CID, [user("Weather in Paris?")], user_id="u1", turn_id="t1")
    await logger.log_messages(CID, [user("Museums?")], name="Museum plans", turn_id="t2")
    assert await name_of(backend) == ("Trip to Lyon", "set")


async def test_a_rename_wins_over_every_later_turn(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    await logger.log_messages(CID, [user("Weather in Paris?")], turn_id="t1")
    renamed = await store.rename(CID, "  Paris   weekend ")
    assert (renamed.name, renamed.name_source) == ("Paris weekend", "set")

    await logger.log_messages(CID, [user("And Lyon?")], turn_id="t2")
    await logger.log_messages(CID, [user("Thanks")], name="Weather chat", turn_id="t3")
    await logger.upsert_conversation(CID)
    assert await name_of(backend) == ("Paris weekend", "set")


async def test_upsert_conversation_with_a_name_replaces_any_name(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("Weather in Paris?")], name="Weather", turn_id="t1")
    assert await name_of(backend) == ("Weather", "runtime")
    await logger.upsert_conversation(CID, name="Paris")
    await logger.upsert_conversation(CID, name="Paris again")
    assert await name_of(backend) == ("Paris again", "set")


async def test_a_runtime_name_replaces_an_automatic_name(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("weather paris pls"), answer()], turn_id="t1")
    assert await name_of(backend) == ("weather paris pls", "auto")
    await logger.log_messages(CID, [user("and lyon")], name=" Weather in\nFrance ", turn_id="t2")
    assert await name_of(backend) == ("Weather in France", "runtime")


async def test_a_runtime_name_on_the_first_turn_is_used_instead_of_the_automatic_one(
    backend: Backend,
) -> None:
    await AgentMessageLogger(backend.db).log_messages(
        CID, [user("weather paris pls")], name="Paris weather"
    )
    assert await name_of(backend) == ("Paris weather", "runtime")


async def test_a_later_runtime_name_replaces_an_earlier_one(backend: Backend) -> None:
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("weather paris pls")], name="Weather", turn_id="t1")
    await logger.log_messages(CID, [user("and a hotel")], name="Paris trip", turn_id="t2")
    await logger.log_messages(CID, [user("cheaper one")], turn_id="t3")
    assert await name_of(backend) == ("Paris trip", "runtime")


async def test_a_retried_turn_does_not_name_again(backend: Backend) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    turn = [user("Weather in Paris?")]
    await logger.log_messages(CID, turn, turn_id="t1")
    await store.rename(CID, "Paris")

    retried = await logger.log_messages(CID, turn, turn_id="t1", name="Weather")

    assert retried.replayed
    assert await name_of(backend) == ("Paris", "set")


@pytest.mark.parametrize("bad_name", ["", "   \n", "x" * 201])
async def test_an_invalid_runtime_name_is_refused_and_nothing_is_written(
    backend: Backend, bad_name: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape("invalid name: it must have 1 to 200")):
        await AgentMessageLogger(backend.db).log_messages(CID, [user("hi")], name=bad_name)
    assert await backend.db.agent_conversations.count_documents({}) == 0
    assert await backend.db.agent_messages.count_documents({}) == 0


async def _a_stray_under_t1s_first_id(backend: Backend) -> None:
    """A message stored under the id turn "t1" derives for its first message (another
    conversation's, left there): "t1" is refused once its reservation has named the
    conversation."""
    stray = {"_id": message_id(CID, "t1", 0), "conversation_id": "other", "seq": 0}
    await backend.db.agent_messages.insert_one({**stray, "role": "user", "content": "stray"})


async def _t1_refused_then_named_by(
    backend: Backend,
    refused_by: AgentMessageLogger,
    next_by: AgentMessageLogger,
    text: str,
    *,
    match: str | None = None,
) -> tuple[tuple[str | None, str | None], tuple[str | None, str | None]]:
    """Turn "t1" ("private question") refused (`Conflict`, matching `match`), then a next
    turn asking `text`: the conversation's name and its source after each."""
    with pytest.raises(Conflict, match=match):
        await refused_by.log_messages(CID, [user("private question"), answer()], turn_id="t1")
    refused = await name_of(backend)
    await next_by.log_messages(CID, [user(text), answer()], turn_id="t-next")
    return refused, await name_of(backend)


async def test_a_turn_refused_after_its_reservation_takes_its_automatic_name_back(
    backend: Backend,
) -> None:
    """A stray message under an id the turn derives refuses it after its reservation named
    the conversation: the block is given back with the name, and the next turn names it."""
    logger = AgentMessageLogger(backend.db)
    await logger.upsert_conversation(CID, user_id="u")
    await _a_stray_under_t1s_first_id(backend)

    refused, then = await _t1_refused_then_named_by(
        backend, logger, logger, "hello world", match="already taken by a message of another turn"
    )

    assert refused == (None, None)
    assert then == ("hello world", "auto")


@pytest.mark.parametrize("earlier", [None, "Earlier runtime name"], ids=["auto", "runtime"])
async def test_a_turn_refused_after_its_reservation_leaves_the_name_it_set_as_it_was(
    backend: Backend, earlier: str | None
) -> None:
    """LIBRARY.md: a retried or refused turn changes no name. A turn naming the conversation
    (`name=`) refused after its reservation set that runtime name (a stray under an id it
    derives) is stored nowhere: the name is the one before it, automatic or a runtime's."""
    logger = AgentMessageLogger(backend.db)
    await logger.log_messages(CID, [user("First question"), answer()], turn_id="t0", name=earlier)
    before = await name_of(backend)
    await _a_stray_under_t1s_first_id(backend)

    with pytest.raises(Conflict, match="already taken by a message of another turn"):
        await logger.log_messages(
            CID, [user("private question"), answer()], turn_id="t1", name="Refused name"
        )

    assert before == (earlier or "First question", "runtime" if earlier else "auto")
    assert await name_of(backend) == before


async def _named_by_a_turn_never_stored(backend: Backend) -> AgentMessageLogger:
    """Turn "t-lost" named the conversation, reserved ten minutes ago (past `abandon_after`)
    and stored nothing (as a crash before its insert); turn "t2" is stored after it."""
    logger = AgentMessageLogger(backend.db, rules=COUNTED)
    await logger.log_messages(CID, [user("secret draft question"), answer()], turn_id="t-lost")
    await backend.db.agent_messages.delete_many({})
    await logger.log_messages(CID, [user("what is the weather"), answer()], turn_id="t2")
    long_ago = datetime.now(UTC) - timedelta(minutes=10)
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$set": {"turns.0.a": long_ago}})
    return logger


async def _popped_empty(backend: Backend) -> ConversationStore:
    """A person pops both messages the stored turn "t2" left: no message is stored."""
    store = ConversationStore(backend.db, rules=COUNTED)
    await store.pop_last_message(CID)
    await store.pop_last_message(CID)
    return store


async def test_pops_leaving_no_message_take_back_a_name_no_stored_message_gives(
    backend: Backend,
) -> None:
    logger = await _named_by_a_turn_never_stored(backend)

    await _popped_empty(backend)
    emptied = await name_of(backend)
    await logger.log_messages(CID, [user("new topic"), answer()], turn_id="t3")

    assert emptied == (None, None)
    assert await name_of(backend) == ("new topic", "auto")


async def test_a_turn_moved_to_the_end_leaves_the_name_to_the_first_stored_user_text(
    backend: Backend,
) -> None:
    logger = await _named_by_a_turn_never_stored(backend)

    moved = await logger.log_messages(
        CID, [user("secret draft question"), answer()], turn_id="t-lost"
    )

    assert moved.messages[0].seq == 4
    assert await name_of(backend) == ("what is the weather", "auto")


async def test_a_turn_given_back_for_other_content_leaves_the_name_to_the_stored_messages(
    backend: Backend,
) -> None:
    """A retry with other content past `abandon_after` gives the first attempt's block back
    (the name it gave with it) and is logged anew at the end, after a stored user text."""
    logger = await _named_by_a_turn_never_stored(backend)

    await logger.log_messages(CID, [user("another draft"), answer()], turn_id="t-lost")

    assert await name_of(backend) == ("what is the weather", "auto")


@pytest.mark.parametrize(
    "retried",
    [
        pytest.param([user("secret draft question"), answer()], id="moved"),
        pytest.param([user("another draft"), answer()], id="given-back-for-other-content"),
    ],
)
async def test_the_name_goes_to_the_stored_messages_while_a_later_turn_is_still_being_written(
    backend: Backend, retried: Turn
) -> None:
    """Turn "t3" reserved after "t2" and its insert is still on its way when the lost turn's
    retry is logged at the end: what the retry leaves pending waits for "t3", its name does
    not, and "t3" landing above "t2" leaves it so (was: the lost turn's name, for good)."""
    logger = await _named_by_a_turn_never_stored(backend)
    await logger.log_messages(CID, [user("a third question"), answer()], turn_id="t3")
    on_its_way = await backend.db.agent_messages.find({"seq": {"$gte": 4}}).to_list(None)
    await backend.db.agent_messages.delete_many({"seq": {"$gte": 4}})

    await logger.log_messages(CID, retried, turn_id="t-lost")
    retaken = await name_of(backend)
    await backend.db.agent_messages.insert_many(on_its_way)  # "t3"'s insert lands

    assert retaken == ("what is the weather", "auto")
    assert await name_of(backend) == ("what is the weather", "auto")


async def test_popping_a_retry_logged_while_a_later_turn_was_being_written_keeps_the_name(
    backend: Backend,
) -> None:
    """The same, then pops remove the retry logged at the end (stored under the ids the lost
    turn's first attempt named the conversation from): the name is the first stored user
    text's, which no pop touched (was: none, for good, though "t2" is stored)."""
    logger = await _named_by_a_turn_never_stored(backend)
    await logger.log_messages(CID, [user("a third question"), answer()], turn_id="t3")
    on_its_way = await backend.db.agent_messages.find({"seq": {"$gte": 4}}).to_list(None)
    await backend.db.agent_messages.delete_many({"seq": {"$gte": 4}})
    await logger.log_messages(CID, [user("another draft"), answer()], turn_id="t-lost")
    await backend.db.agent_messages.insert_many(on_its_way)
    store = ConversationStore(backend.db, rules=COUNTED)

    assert (await store.pop_last_message(CID)).content == "Sure."
    assert (await store.pop_last_message(CID)).content == "another draft"
    await logger.log_messages(CID, [user("a fourth question"), answer()], turn_id="t4")

    assert await name_of(backend) == ("what is the weather", "auto")


async def test_a_give_back_whose_fold_is_lost_still_takes_its_name_with_it(
    backend: Backend,
) -> None:
    """The update folding what the lost turn's give-back leaves pending is lost (a dropped
    connection); the retry is then logged anew under the same ids with other text: the name
    went with the block, in the give-back's own update (was: the lost turn's, for good)."""
    logger = await _named_by_a_turn_never_stored(backend)
    give_up = logger._give_up

    async def lost(*args: Any, **kwargs: Any) -> None:
        logger._give_up = give_up  # type: ignore[method-assign]
        raise StorageUnavailable("the fold's update was lost")

    logger._give_up = lost  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        await logger.log_messages(CID, [user("another draft"), answer()], turn_id="t-lost")
    retried = await logger.log_messages(CID, [user("another draft"), answer()], turn_id="t-lost")

    assert retried.messages[0].seq == 4
    assert await name_of(backend) == ("what is the weather", "auto")


async def test_a_name_a_person_set_stays_when_the_turn_that_named_first_moves(
    backend: Backend,
) -> None:
    logger = await _named_by_a_turn_never_stored(backend)
    await ConversationStore(backend.db).rename(CID, "Drafts")

    await logger.log_messages(CID, [user("secret draft question"), answer()], turn_id="t-lost")
    await ConversationStore(backend.db, rules=COUNTED).pop_last_message(CID)

    assert await name_of(backend) == ("Drafts", "set")


async def test_a_moved_turn_never_names_from_a_message_of_an_earlier_life(
    backend: Backend,
) -> None:
    """A deleted life's late insert lands in a gap of the conversation started again under
    its id: the fold after a move reads only this life's messages, so the name goes to this
    life's first stored user text, never to the deleted one's."""
    logger = AgentMessageLogger(backend.db, rules=COUNTED)
    await logger.log_messages(CID, [user("OLD LIFE SECRET"), answer()], user_id="alice")
    old = await backend.db.agent_messages.find_one({"conversation_id": CID, "seq": 0})
    await ConversationStore(backend.db).delete(CID, user_id="alice")
    stray = {"_id": message_id(CID, "tx", 0), "conversation_id": "other", "seq": 0}
    await backend.db.agent_messages.insert_one({**stray, "role": "user", "content": "x"})
    with pytest.raises(Conflict):  # refused after its reservation: 0-1 given back, a gap
        await logger.log_messages(CID, [user("refused"), answer()], turn_id="tx", user_id="bob")
    await backend.db.agent_messages.delete_many({"conversation_id": "other"})
    lost = [user("secret draft question"), answer()]
    await logger.log_messages(CID, lost, turn_id="t-lost", user_id="bob")
    await backend.db.agent_messages.delete_many({})
    await backend.db.agent_messages.insert_one(old)  # the deleted life's insert, late
    await logger.log_messages(CID, [user("what is the weather"), answer()], user_id="bob")
    long_ago = datetime.now(UTC) - timedelta(minutes=10)
    await backend.db.agent_conversations.update_one({"_id": CID}, {"$set": {"turns.1.a": long_ago}})

    moved = await logger.log_messages(CID, lost, turn_id="t-lost", user_id="bob")

    assert moved.messages[0].seq == 6
    assert await name_of(backend) == ("what is the weather", "auto")


async def test_a_give_back_never_names_from_a_message_popped_meanwhile(
    backend: Backend,
) -> None:
    """The give-back reads the first stored user text, a person pops it before the
    give-back's update: the name is not that popped text, and the next turn names it."""
    logger = AgentMessageLogger(backend.db, rules=COUNTED)
    other = AgentMessageLogger(backend.db, rules=COUNTED)
    store = ConversationStore(backend.db, rules=COUNTED)
    await other.log_messages(CID, [answer("Hi, how can I help?")], turn_id="t0")
    await _a_stray_under_t1s_first_id(backend)
    read = logger._named_without

    async def popped_meanwhile(*args: Any) -> dict[str, Any]:
        long_ago = datetime.now(UTC) - timedelta(minutes=10)  # t1 slower than abandon_after
        await backend.db.agent_conversations.update_one(
            {"_id": CID}, {"$set": {"turns.1.a": long_ago}}
        )
        await other.log_messages(CID, [user("what is the weather"), answer()], turn_id="t2")
        names = await read(*args)
        await store.pop_last_message(CID)
        await store.pop_last_message(CID)
        return names

    logger._named_without = popped_meanwhile  # type: ignore[method-assign]
    refused, then = await _t1_refused_then_named_by(backend, logger, other, "new topic")

    assert refused == (None, None)
    assert then == ("new topic", "auto")


async def test_a_moved_turn_names_a_conversation_pops_left_unnamed(backend: Backend) -> None:
    """Pops leave no message and take the automatic name back; the lost turn's retry, moved
    to the end, is then the first stored user text and names the conversation."""
    logger = await _named_by_a_turn_never_stored(backend)
    await _popped_empty(backend)

    await logger.log_messages(CID, [user("secret draft question"), answer()], turn_id="t-lost")

    assert await name_of(backend) == ("secret draft question", "auto")


async def test_a_moved_turn_never_names_a_conversation_a_person_left_unnamed(
    backend: Backend,
) -> None:
    logger = await _named_by_a_turn_never_stored(backend)
    store = await _popped_empty(backend)
    await store.rename(CID, "Drafts")

    await logger.log_messages(CID, [user("secret draft question"), answer()], turn_id="t-lost")

    assert await name_of(backend) == ("Drafts", "set")


@pytest.mark.wire
@pytest.mark.parametrize(
    ("turn", "name"),
    [
        pytest.param([user("Weather in Paris?"), answer()], None, id="names"),
        pytest.param([user("Weather in Paris?")], "Paris weather", id="runtime-name"),
        pytest.param([{"role": "system", "content": "Trigger"}, answer()], None, id="unnamed"),
    ],
)
async def test_naming_costs_no_extra_round_trip(
    wire_backend: Backend, turn: Turn, name: str | None
) -> None:
    assert wire_backend.commands is not None
    logger = AgentMessageLogger(wire_backend.db, rules=COUNTED)
    wire_backend.commands.clear()
    await logger.log_messages(CID, turn, name=name, turn_id="t1")
    await logger.log_messages(CID, [user("Later text"), answer()], turn_id="t2")
    assert wire_backend.commands.names == ["findAndModify", "insert"] * 2
    assert await name_of(wire_backend) != (None, None)


@given(text=st.text(alphabet=st.sampled_from("ab é\n\t."), max_size=80), limit=st.integers(2, 70))
def test_an_automatic_name_is_a_word_boundary_prefix_of_the_collapsed_text(
    text: str, limit: int
) -> None:
    name = auto_name(UserMessage(content=text), limit)
    collapsed = collapse_whitespace(text)
    if not collapsed:
        assert name is None
        return
    assert name is not None
    assert len(name) <= limit
    if len(collapsed) <= limit:
        assert name == collapsed
        return
    kept = name.removesuffix(ELLIPSIS)
    assert name.endswith(ELLIPSIS)
    assert kept
    assert collapsed.startswith(kept)
    assert collapsed[len(kept)] == " " or " " not in kept  # a word cut only when it is the first


SPOOFING = [
    pytest.param("Invoice \u202efdp.exe", id="right-to-left-override"),
    pytest.param("Report\u2066 hidden\u2069", id="bidi-isolate"),
    pytest.param("Alert \x1b[31mred\x1b[0m", id="terminal-escape"),
    pytest.param("Null\x00byte", id="nul"),
    pytest.param("Bell\x07 and \x9b C1", id="c0-and-c1-controls"),
    pytest.param("Invoice \u200fcod.exe", id="right-to-left-mark"),
    pytest.param("Left\u200e mark", id="left-to-right-mark"),
    pytest.param("Arabic \u061c letter mark", id="arabic-letter-mark"),
    pytest.param("Digits \u206e123", id="deprecated-digit-shapes"),
]


@pytest.mark.parametrize("bad_name", SPOOFING)
async def test_a_name_holding_control_or_direction_characters_is_refused(
    backend: Backend, bad_name: str
) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    with pytest.raises(InvalidInput, match=r"invalid name: .*U\+[0-9A-F]{4}.* at character \d+"):
        await logger.log_messages(CID, [user("hi")], name=bad_name)
    assert await backend.db.agent_messages.count_documents({}) == 0
    await logger.log_messages(CID, [user("hi")], turn_id="t1")
    with pytest.raises(InvalidInput, match=r"U\+[0-9A-F]{4}"):
        await store.rename(CID, bad_name)
    assert await name_of(backend) == ("hi", "auto")


@pytest.mark.parametrize("text", SPOOFING)
async def test_automatic_names_and_previews_leave_control_and_direction_characters_out(
    backend: Backend, text: str
) -> None:
    await AgentMessageLogger(backend.db).log_messages(CID, [user(text)], turn_id="t1")
    conversation = await ConversationStore(backend.db).get_conversation(CID)
    for shown_text in (conversation.name, conversation.last_message_preview):
        assert shown_text
        assert not re.search(f"[{HIDDEN_CHARACTERS}]", shown_text)
    stored = await ConversationStore(backend.db).transcript(CID)
    assert stored[0].content == text  # the message itself is kept as written


def test_a_name_in_any_other_script_is_kept_without_its_direction_marks() -> None:
    arabic = "\u0645\u0631\u062d\u0628\u0627 \u0639\u0627\u0644\u0645"
    text = arabic.replace(" ", " \u200f")  # a right-to-left mark, left out as any other
    assert auto_name(UserMessage(content=text), 60) == arabic


# Characters that show nothing: format characters (Unicode category Cf) and the fillers and
# selectors Unicode ignores by default. A name of only these, and white space, is blank.
INVISIBLE_ONLY = [
    pytest.param("\u200b", id="zero-width-space"),
    pytest.param("\u2060", id="word-joiner"),
    pytest.param("\ufeff", id="byte-order-mark"),
    pytest.param("\u3164", id="hangul-filler"),
    pytest.param("\u115f\u1160", id="hangul-jamo-fillers"),
    pytest.param("\uffa0", id="halfwidth-hangul-filler"),
    pytest.param("\u00ad\u034f", id="soft-hyphen-and-grapheme-joiner"),
    pytest.param("\ufe0f\U000e0100", id="variation-selectors"),
    pytest.param("\U000e0041\U000e007f", id="tag-characters"),
    pytest.param("\u2800", id="braille-blank"),
    pytest.param(" \u200b \u2060\u200c\u200d ", id="joiners-and-white-space"),
]


@pytest.mark.parametrize("blank", INVISIBLE_ONLY)
async def test_a_name_that_shows_nothing_is_refused_as_blank(backend: Backend, blank: str) -> None:
    logger, store = AgentMessageLogger(backend.db), ConversationStore(backend.db)
    with pytest.raises(InvalidInput, match=r"invalid name: .* show something besides invisible"):
        await logger.log_messages(CID, [user("hi")], name=blank)
    assert await backend.db.agent_messages.count_documents({}) == 0
    await logger.log_messages(CID, [user("hi")], turn_id="t1")
    with pytest.raises(InvalidInput, match=r"invalid name: .* show something besides invisible"):
        await store.rename(CID, blank)
    assert await name_of(backend) == ("hi", "auto")


@pytest.mark.parametrize("blank", INVISIBLE_ONLY)
def test_a_text_that_shows_nothing_names_nothing(blank: str) -> None:
    assert auto_name(UserMessage(content=blank), 60) is None


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645", id="persian-zwnj"),
        pytest.param("\U0001f468\u200d\U0001f469\u200d\U0001f467 family", id="emoji-zwj"),
        pytest.param("\u2764\ufe0f trip", id="emoji-variation-selector"),
        pytest.param("co\u00adop", id="soft-hyphen-inside"),
    ],
)
async def test_invisible_characters_inside_a_visible_name_are_kept(
    backend: Backend, name: str
) -> None:
    await AgentMessageLogger(backend.db).log_messages(CID, [user("hi")], turn_id="t1")
    await ConversationStore(backend.db).rename(CID, name)
    assert await name_of(backend) == (name, "set")
