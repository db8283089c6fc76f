"""The converter's problem report: a problem only where content was not placed as it was, or
was changed; derived ids for conversations whose id is not an identifier; lenient numbers;
the time an undated turn gets, and the problem saying which."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import bson
import pytest
from bson import Code, DatetimeMS, Decimal128, Int64, ObjectId

from agent_store import AgentMessageLogger, ConversationStore, LegacyTurns
from agent_store.core import Conflict, NotFound, StorageFailure
from agent_store.legacy import (
    LEGACY_TURNS,
    SESSION_HITL,
    as_text,
    convert,
    derived_conversation_id,
    derived_user_id,
    group_conversations,
    id_text,
    legacy_turn_documents,
    named_id,
    parse_turns,
    pending_from_session_hitl,
    prompt_conversation,
    prompts_filter,
    tell_apart,
    with_session_prompts,
)
from agent_store.store import CONVERSATIONS, MESSAGES
from migrations.transcript import from_legacy, from_messages
from scripts.legacy_corpus import MESSY_START, NOT_AN_IDENTIFIER, messy_corpus
from tests.conftest import Backend


def conversation(conversation_id: str) -> list[dict[str, Any]]:
    return [d for d in messy_corpus() if d["conversation_id"] == conversation_id]


def test_a_conversation_id_that_is_not_an_identifier_gets_a_derived_stable_one() -> None:
    first = convert(conversation(NOT_AN_IDENTIFIER))
    again = convert(conversation(NOT_AN_IDENTIFIER))

    derived = derived_conversation_id(NOT_AN_IDENTIFIER)
    assert first.conversation_id == derived == again.conversation_id
    assert first.conversation is not None
    assert first.conversation.id == derived
    assert first.conversation.legacy_conversation_id == NOT_AN_IDENTIFIER
    assert [m.content for m in first.messages][-1].startswith("yes")
    assert {m.conversation_id for m in first.messages} == {derived}
    [problem] = first.problems
    assert (problem.kind, problem.placed, problem.content) == (
        "derived_conversation_id",
        True,
        NOT_AN_IDENTIFIER,
    )
    assert derived in problem.detail


@pytest.mark.parametrize("odd", ["conv-1\n", "conv-1\r\n", "conv-1\u2028", "\nconv-1"])
def test_an_id_with_a_line_break_at_an_end_is_no_identifier_and_gets_a_derived_one(
    odd: str,
) -> None:
    """A pattern's `$` also matches before a last newline: no id check may read it so."""
    turn = {"_id": f"{odd}t", "conversation_id": odd, "user_message": "hi",
            "created_at": MESSY_START}  # fmt: skip

    conversion = convert([turn])

    assert conversion.conversation_id == derived_conversation_id(odd)
    assert [p.kind for p in conversion.problems] == ["derived_conversation_id"]
    assert all(m.turn_id and "\n" not in m.turn_id for m in conversion.messages)


@pytest.mark.parametrize("dots", [".", ".."])
def test_a_dot_or_two_dots_as_a_legacy_id_is_no_identifier_and_gets_a_derived_one(
    dots: str,
) -> None:
    """No id is `.` or `..` (a URL path reads them as a folder and its parent): a conversation
    so named is stored under a derived id, and a user so named owns it under the user id
    derived from it, never no one (`invalid_user_id`, not placed)."""
    turn = {"_id": "t-dots", "conversation_id": dots, "user_id": dots, "user_message": "hi",
            "created_at": MESSY_START}  # fmt: skip

    conversion = convert([turn])

    assert conversion.conversation_id == derived_conversation_id(dots)
    assert conversion.conversation is not None
    assert conversion.conversation.legacy_conversation_id == dots
    assert conversion.conversation.user_id == derived_user_id(dots)
    assert {m.user_id for m in conversion.messages} == {derived_user_id(dots)}
    kinds = {p.kind: p.placed for p in conversion.problems}
    assert kinds == {"derived_conversation_id": True, "invalid_user_id": False}


def test_turns_naming_a_conversation_by_its_legacy_id_or_by_its_derived_id_are_one() -> None:
    """A live turn's legacy copy written before the dual write named a conversation as its
    legacy turns do names it by its derived id: whichever turn comes first, the conversation
    records the legacy id the others name, and says so in a problem."""
    derived = derived_conversation_id(NOT_AN_IDENTIFIER)
    copy = {"_id": "dual-1", "conversation_id": derived, "user_id": "u-1", "dual_write": True,
            "turn_id": "native-1", "created_at": MESSY_START, "user_message": "«LIVE»"}  # fmt: skip
    later = {"_id": "t-1", "conversation_id": NOT_AN_IDENTIFIER, "user_id": "u-1",
             "created_at": MESSY_START + timedelta(hours=1), "user_message": "«OLD»"}  # fmt: skip

    conversion = convert([later, copy])

    assert conversion.conversation is not None
    assert conversion.conversation.legacy_conversation_id == NOT_AN_IDENTIFIER
    assert [m.content for m in conversion.messages] == ["«LIVE»", "«OLD»"]
    [problem, unsure] = conversion.problems
    assert (problem.kind, problem.legacy_id, problem.content) == (
        "derived_conversation_id",
        "t-1",
        NOT_AN_IDENTIFIER,
    )
    # a copy recording no digest of its live messages cannot tell it converts back to them
    assert (unsure.kind, unsure.legacy_id, unsure.placed) == (
        "dual_write_not_exact",
        "dual-1",
        False,
    )


def test_turns_without_a_conversation_id_become_a_conversation_each() -> None:
    orphan = {"_id": "lost-1", "user_message": "where am I?", "created_at": MESSY_START}
    conversion = convert([orphan])
    assert conversion.conversation_id == derived_conversation_id(None, turn_key="lost-1")
    assert [m.content for m in conversion.messages] == ["where am I?"]
    assert [p.kind for p in conversion.problems] == ["derived_conversation_id"]


@pytest.mark.parametrize("blank", [None, "", "   "], ids=["null", "empty", "spaces"])
def test_turns_naming_a_blank_conversation_become_a_conversation_each(blank: Any) -> None:
    """A blank id names no conversation, as for `session_hitl`: two users' turns under one
    are never one conversation that one of them owns."""
    turns = [
        {"_id": f"b-{user}", "conversation_id": blank, "user_id": user,
         "created_at": MESSY_START, "user_message": f"{user}'s question"}
        for user in ("alice", "bob")
    ]  # fmt: skip
    grouped = group_conversations(parse_turns(turns))

    assert sorted(grouped) == [
        derived_conversation_id(None, turn_key=f"b-{u}") for u in ("alice", "bob")
    ]
    assert [convert(g).conversation.user_id for g in grouped.values()] == ["alice", "bob"]


async def test_a_turn_naming_a_blank_conversation_is_read_and_deleted_under_its_own_id(
    backend: Backend,
) -> None:
    turn = {"_id": "b-1", "conversation_id": "  ", "user_id": "alice",
            "created_at": MESSY_START, "user_message": "alice's question"}  # fmt: skip
    await backend.db[LEGACY_TURNS].insert_one(turn)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    own_id = derived_conversation_id(None, turn_key="b-1")

    found = await store.get_conversation(own_id)
    assert (found.id, found.user_id) == (own_id, "alice")
    assert (await store.delete(own_id)).legacy_turns == 1


@pytest.mark.parametrize("turn_id", ["turn 1", "t" * 101, "ticket#7"], ids=["space", "long", "#"])
async def test_a_blank_id_turn_whose_id_is_hashed_is_read_and_deleted_under_its_own_id(
    turn_id: str, backend: Backend
) -> None:
    """The migration names it `legacy-turn-h<sha256[:32]>`: the store finds the turn by it."""
    turn = {"_id": turn_id, "conversation_id": " ", "user_id": "alice",
            "created_at": MESSY_START, "user_message": "alice's question"}  # fmt: skip
    await backend.db[LEGACY_TURNS].insert_many([turn, {**turn, "_id": "b-other"}])
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    own_id = derived_conversation_id(None, turn_key=parse_turns([turn])[0].key)
    assert own_id.startswith("legacy-turn-h")

    assert (await store.get_conversation(own_id)).user_id == "alice"
    assert (await store.delete(own_id, user_id="alice")).legacy_turns == 1
    assert [t["_id"] async for t in backend.db[LEGACY_TURNS].find()] == ["b-other"]


async def test_a_prompt_naming_a_blank_conversation_is_found_by_its_session(
    backend: Backend,
) -> None:
    prompts = backend.db["session_hitl"]
    await prompts.insert_one({"conversation_id": " ", "session_id": "s-1", "request_id": "r"})
    assert await prompts.count_documents(prompts_filter("s-1")) == 1


PROMPT_NAMINGS = {
    "text": ({"conversation_id": "c-1"}, "c-1"),
    "number zero, session aside": ({"conversation_id": 0, "session_id": "c-1"}, "0"),
    "double zero, by its value": ({"conversation_id": 0.0, "session_id": "c-1"}, "0"),
    "false": ({"conversation_id": False, "session_id": "c-1"}, "False"),
    "blank, by its session": ({"conversation_id": " ", "session_id": "s-1"}, "s-1"),
    "none, by its session": ({"session_id": 7}, "7"),
    "blank": ({"conversation_id": "   "}, None),
    "blank and a blank session": ({"conversation_id": "", "session_id": "\t"}, None),
}


@pytest.mark.parametrize(("names", "named"), PROMPT_NAMINGS.values(), ids=list(PROMPT_NAMINGS))
async def test_a_prompt_belongs_to_the_conversation_whose_prompts_filter_finds_it(
    backend: Backend, names: dict[str, Any], named: str | None
) -> None:
    """One naming of a prompt's conversation (`prompt_conversation`), the one `prompts_filter`
    finds prompts by: a blank id names none, a falsy one (0, False) names its text."""
    prompts = backend.db["session_hitl"]
    await prompts.insert_one({"_id": "p-1", **names, "request_id": "r"})

    assert prompt_conversation(names) == named
    for name in ("c-1", "0", "0.0", "False", "s-1", "7"):
        found = await prompts.count_documents(prompts_filter(name))
        assert found == (1 if name == named else 0), name


def test_numbers_written_as_strings_are_read() -> None:
    conversion = convert(conversation("mess-numbers-dates"))
    usage = [(m.token_usage, m.latency_ms) for m in conversion.messages if m.role == "assistant"]
    assert [(u.input_tokens, u.output_tokens) if u else None for u, _ in usage] == [
        (1200, 35),
        (10, 7),
    ]
    assert [latency for _, latency in usage] == [850, 13]
    assert conversion.conversation is not None
    assert conversion.conversation.usage.input_tokens == 1210
    assert "unreadable_number" not in [p.kind for p in conversion.problems]


def test_a_number_that_cannot_be_read_is_a_problem_holding_it() -> None:
    [turn] = conversation("mess-unplaced")
    conversion = convert([turn])
    [problem] = [p for p in conversion.problems if p.kind == "unreadable_number"]
    assert problem.field == "token_usage"
    assert problem.placed is False
    assert problem.content == turn["token_usage"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("latency_ms", Int64(2**63 - 1)),
        ("latency_ms", 2**53),
        ("token_usage", {"input_tokens": 2**53, "output_tokens": 5}),
        ("token_usage", {"input_tokens": 7, "output_tokens": Int64(2**63 - 1)}),
    ],
    ids=["a 'not measured' latency", "a latency past 2**53", "input tokens", "output tokens"],
)
def test_a_number_past_what_a_message_keeps_is_a_problem_holding_it_never_the_turn(
    field: str, value: Any
) -> None:
    """A count above 2**53 - 1 (a 64-bit "not measured" placeholder among them) is no count a
    message keeps: the number is lost to an `unreadable_number` problem, never the turn."""
    conversion = convert([{**usage_turn(None), field: value}])

    assert [(m.role, m.content) for m in conversion.messages] == [("user", "q"), ("assistant", "a")]
    assert [(p.kind, p.field, p.placed, p.content) for p in conversion.problems] == [
        ("unreadable_number", field, False, value)
    ]


@pytest.mark.parametrize(
    "value",
    [
        -0.4,
        "-0.4",
        -1,
        "-3",
        "1_000",
        "\u0661\u0662",
        "\uff11\uff12",
        "12\u00b2",
        "inf",
        "nan",
        "0x10",
    ],
    ids=[
        "a negative fraction",
        "a negative fraction as text",
        "a negative number",
        "a negative number as text",
        "digits grouped by underscores",
        "arabic-indic digits",
        "full-width digits",
        "a superscript digit",
        "an infinity as text",
        "nan as text",
        "a hexadecimal text",
    ],
)
@pytest.mark.parametrize("field", ["latency_ms", "input_tokens"])
def test_a_count_that_is_negative_or_no_ascii_decimal_spelling_is_a_problem_holding_it(
    field: str, value: Any
) -> None:
    """MIGRATION.md: a count is a number from 0 to 2**53 - 1, or its text in ASCII decimal
    digits; anything else (negative, `-0.4` too, which rounds to 0; digits grouped by `_`,
    digits of another script, which Python's `float` reads) is an `unreadable_number`
    problem holding the value, never a count read as another."""
    usage = {"input_tokens": value, "output_tokens": 1} if field == "input_tokens" else None
    turn = usage_turn(usage) | ({"latency_ms": value} if field == "latency_ms" else {})
    conversion = convert([turn])

    [answer] = [m for m in conversion.messages if m.role == "assistant"]
    assert answer.latency_ms is None
    assert answer.token_usage is None or answer.token_usage.input_tokens == 0
    kept = usage if field == "input_tokens" else value
    wanted = "token_usage" if field == "input_tokens" else field
    assert [(p.kind, p.field, p.placed, p.content) for p in conversion.problems] == [
        ("unreadable_number", wanted, False, kept)
    ]


@pytest.mark.parametrize(
    ("value", "count"),
    [("  12.4e2 ", 1240), ("+7", 7), ("850.6", 851), ("-0", 0), (-0.0, 0), (".5E1", 5)],
)
def test_a_count_spelt_in_ascii_decimal_digits_is_read(value: Any, count: int) -> None:
    conversion = convert([usage_turn(None) | {"latency_ms": value}])

    [answer] = [m for m in conversion.messages if m.role == "assistant"]
    assert answer.latency_ms == count
    assert conversion.problems == []


def test_a_first_turn_without_a_time_takes_the_next_turns_and_the_problem_says_so() -> None:
    conversion = convert(conversation("mess-numbers-dates"))
    second_turn_time = MESSY_START + timedelta(minutes=5)
    assert conversion.messages[0].created_at == second_turn_time
    assert conversion.conversation is not None
    assert conversion.conversation.created_at == second_turn_time
    [problem] = [p for p in conversion.problems if p.kind == "missing_created_at"]
    assert problem.legacy_id == "turn-first"
    assert "the next readable turn's time" in problem.detail
    assert "turn-second" in problem.detail
    assert "previous" not in problem.detail


def test_a_turn_without_a_time_of_its_own_takes_its_object_ids_and_says_so() -> None:
    at = datetime(2024, 2, 3, 4, 5, 6, tzinfo=UTC)
    turn = {"_id": ObjectId.from_datetime(at), "conversation_id": "c-oid", "user_message": "hi"}
    conversion = convert([turn])
    assert conversion.messages[0].created_at == at
    [problem] = conversion.problems
    assert "its ObjectId's time" in problem.detail


def test_a_conversation_without_any_time_takes_the_time_it_is_given() -> None:
    given = datetime(2020, 1, 1, tzinfo=UTC)
    conversion = convert(conversation("mess-undated"), undated_at=given)
    assert {m.created_at for m in conversion.messages} == {given}
    [problem] = conversion.problems
    assert "no turn of the conversation has a readable time, so 2020-01-01" in problem.detail


@pytest.mark.parametrize(
    "created_at",
    [1614592800, 1614592800.0, 1614592800000, Int64(1614592800000), "1614592800",
     " 1614592800000 ", "1614592800.0", " 2021-03-01T10:00:00Z ", "2021-03-01T10:00:00+00:00",
     "2021-03-01 10:00:00z", bson.Decimal128("1614592800"), bson.Decimal128("1614592800000"),
     "Mon, 01 Mar 2021 10:00:00 GMT", "Mon, 01 Mar 2021 11:00:00 +0100",
     bson.Timestamp(1614592800, 1)],
    ids=["seconds", "seconds as a float", "milliseconds", "milliseconds as int64",
         "seconds as text", "milliseconds as text in spaces", "seconds as decimal text",
         "iso text in spaces", "iso text", "rfc 3339 with a lowercase z",
         "seconds as decimal128", "milliseconds as decimal128", "rfc 2822 (http, e-mail)",
         "rfc 2822 with an offset", "a bson timestamp (its seconds)"],
)  # fmt: skip
def test_a_time_written_as_whole_epoch_seconds_or_milliseconds_is_read(created_at: Any) -> None:
    """A number or its text by one rule (`epoch_number`); ISO text with spaces around it."""
    turn = {"_id": "e-1", "conversation_id": "c-epoch", "created_at": created_at,
            "user_message": "hi"}  # fmt: skip
    conversion = convert([turn])

    assert conversion.messages[0].created_at == datetime(2021, 3, 1, 10, tzinfo=UTC)
    assert conversion.problems == []


@pytest.mark.parametrize(
    ("created_at", "meant"),
    [("Fri Mar 01 2024 10:30:00 GMT+0200 (Central European Summer Time)", "08:30"),
     ("Fri Mar 01 2024 04:00:00 GMT-0500 (Eastern Standard Time)", "09:00"),
     ("Fri Mar 01 2024 10:30:00 GMT+0200", "08:30"),
     ("Fri, 01 Mar 2024 10:30:00 +02:00", "08:30"),
     ("Fri, 01 Mar 2024 10:30:00 +0200", "08:30"),
     ("1 Mar 2024 04:00 EST", "09:00"),
     ("Fri, 01 Mar 2024 01:30:00 PDT", "08:30"),
     ("Fri, 01 Mar 2024 08:30:00 -0000", "08:30"),
     ("fri, 01 mar 2024 08:30:00 gmt", "08:30")],
    ids=["javascript Date.toString, east of utc", "javascript Date.toString, west of utc",
         "javascript Date.toString without its zone's name", "rfc 2822 with a colon offset",
         "rfc 2822", "rfc 2822 without a weekday or seconds, a us zone",
         "rfc 2822, a us daylight zone", "rfc 2822, -0000", "rfc 2822 in lower case"],
)  # fmt: skip
def test_a_time_written_as_text_with_an_offset_is_read_at_that_offset(
    created_at: str, meant: str
) -> None:
    """JavaScript's `Date.toString()` and an RFC 2822 date name their offset: 10:30 at +02:00
    is 08:30 UTC, never 10:30."""
    turn = {"_id": "d-1", "conversation_id": "c-date", "created_at": created_at,
            "user_message": "hi"}  # fmt: skip
    conversion = convert([turn])

    hour, minute = map(int, meant.split(":"))
    assert conversion.messages[0].created_at == datetime(2024, 3, 1, hour, minute, tzinfo=UTC)
    assert conversion.problems == []


@pytest.mark.parametrize(
    "created_at",
    ["Mar 1, 2024 9:00:00 PM", "3/1/2024, 9:00:00 PM", "Fri, 01 Mar 2024 10:30:00",
     "Fri Mar 01 2024 10:30:00", "Fri, 01 Mar 2024 10:30:00 CEST", "Fri, 01 Mar 2024 10:30:00 XYZ",
     "Fri, 01 Mar 2024 10:30:00 GMT and then some", "Sat, 01 Mar 2024 10:30:00 GMT",
     "Fri Mar 01 2024 10:30:00 GMT+0200 (CEST) later", "01 Mar 24 10:30:00 GMT",
     "Fri, 01 Mar 2024 10:30:00 A", "Fri, 01 Mar 2024 25:30:00 GMT"],
    ids=["am/pm without a zone", "a locale's date", "rfc 2822 without a zone",
         "javascript without a zone", "a zone's abbreviation rfc 2822 does not define",
         "an unknown zone", "text left over", "a weekday the date is not",
         "text after the zone's name", "a two-digit year", "a military zone", "no hour of a day"],
)  # fmt: skip
def test_a_time_written_as_text_that_cannot_be_read_exactly_is_no_time(created_at: str) -> None:
    """Text the reader cannot read whole (an offset, AM or PM, a weekday) is no time: the turn
    is dated by its neighbours and a `missing_created_at` problem holds the text, never a
    reading with part of it ignored."""
    dated = datetime(2024, 3, 1, 12, tzinfo=UTC)
    turns = [
        {"_id": "d-1", "conversation_id": "c-date", "created_at": created_at,
         "user_message": "EVENING"},
        {"_id": "d-2", "conversation_id": "c-date", "created_at": dated, "user_message": "NOON"},
    ]  # fmt: skip
    conversion = convert(turns)

    assert {m.created_at for m in conversion.messages} == {dated}
    [problem] = conversion.problems
    assert (problem.kind, problem.legacy_id, problem.content) == (
        "missing_created_at", "d-1", created_at)  # fmt: skip


def test_milliseconds_as_text_that_iso_reads_as_a_time_before_1970_are_milliseconds() -> None:
    """`"1704101400000"` is also ISO's basic form of 1704-10-14, which no store holds: the
    text is read as the number it spells, as any other epoch text is."""
    turn = {"_id": "e-1", "conversation_id": "c-epoch", "created_at": "1704101400000",
            "user_message": "hi"}  # fmt: skip
    conversion = convert([turn])

    assert conversion.messages[0].created_at == datetime(2024, 1, 1, 9, 30, tzinfo=UTC)
    assert conversion.problems == []


MICROS = datetime(2024, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("later", "earlier"),
    [
        ("2024-01-01T00:00:00.000900+00:00", "2024-01-01T00:00:00.000100+00:00"),
        (MICROS + timedelta(microseconds=900), MICROS + timedelta(microseconds=100)),
        (datetime(2024, 1, 1, 0, 0, 0, 900), datetime(2024, 1, 1, 0, 0, 0, 100)),
        ("2024-01-01T00:00:00.000000900Z", "2024-01-01T00:00:00.000000100Z"),
        ("2024-01-01T00:00:00.0000001Z", "2024-01-01T00:00:00Z"),
        ("2024-01-01T00:00:00.0000001Z", MICROS),
        ("20240101T010000,0000000000002+01:00", "2024-01-01T00:00:00.0000000000001Z"),
    ],
    ids=[
        "iso-text",
        "aware-datetime",
        "naive-datetime",
        "nanoseconds",
        "a tenth of a microsecond after none",
        "a tenth of a microsecond after a datetime",
        "past nanoseconds at an offset",
    ],
)
def test_turns_less_than_a_millisecond_apart_keep_their_time_order(
    later: Any, earlier: Any
) -> None:
    """MIGRATION.md step 2: turns by time (ties in stored order), at the precision they were
    written with (an ISO text's digits past the microsecond a datetime holds too: Go's
    RFC3339Nano); only the stored times are cut to the millisecond BSON holds. `verify`
    renders the legacy turns in that one order."""
    turns = [
        {"_id": "t-b", "conversation_id": "c-us", "created_at": later,
         "user_message": "SECOND q", "response_parts": [{"type": "text", "content": "SECOND a"}]},
        {"_id": "t-a", "conversation_id": "c-us", "created_at": earlier,
         "user_message": "FIRST q", "response_parts": [{"type": "text", "content": "FIRST a"}]},
    ]  # fmt: skip
    conversion = convert(turns)

    assert [m.content for m in conversion.messages] == [
        "FIRST q",
        "FIRST a",
        "SECOND q",
        "SECOND a",
    ]
    assert {m.created_at for m in conversion.messages} == {MICROS}
    assert conversion.problems == []
    assert from_legacy(parse_turns(turns)).lines == (
        "user: FIRST q",
        "assistant: FIRST a",
        "user: SECOND q",
        "assistant: SECOND a",
    )


@pytest.mark.parametrize(
    "created_at",
    [1614592800.5, -5, 0, 32503680000, 10**16, True, "1614592800.5", "0", "32503680000"],
    ids=[
        "a fraction",
        "before 1970",
        "a placeholder zero",
        "seconds in the year 3000",
        "past now in milliseconds",
        "a bool",
        "a fraction as text",
        "a placeholder zero as text",
        "the year 3000 as text",
    ],
)
def test_a_number_that_is_no_epoch_time_is_a_problem_saying_it_was_not_read(
    created_at: Any,
) -> None:
    given = datetime(2020, 1, 1, tzinfo=UTC)
    turn = {"_id": "e-1", "conversation_id": "c-epoch", "created_at": created_at,
            "user_message": "hi"}  # fmt: skip
    conversion = convert([turn], undated_at=given)

    assert conversion.messages[0].created_at == given
    [problem] = conversion.problems
    assert (problem.kind, problem.placed, problem.content) == (
        "missing_created_at",
        True,
        created_at,
    )
    if not isinstance(created_at, bool):
        assert "is a number, not epoch seconds or milliseconds" in problem.detail


def test_an_eight_digit_text_is_an_iso_date_not_epoch_seconds() -> None:
    """ISO text is read first: `20210301` is the basic form of 2021-03-01."""
    turn = {"_id": "e-1", "conversation_id": "c-epoch", "created_at": "20210301",
            "user_message": "hi"}  # fmt: skip
    assert convert([turn]).messages[0].created_at == datetime(2021, 3, 1, tzinfo=UTC)


def test_a_hitl_turn_whose_response_text_is_its_prompt_is_not_a_problem() -> None:
    conversion = convert(conversation("mess-hitl"))
    assert conversion.problems == []


def test_latency_of_a_turn_without_an_answer_goes_on_its_last_message() -> None:
    conversion = convert(conversation("mess-hitl"))
    upload = conversion.messages[-1]
    assert upload.upload is not None
    assert upload.latency_ms == 300


def test_token_usage_of_a_turn_without_an_answer_counts_on_the_conversation() -> None:
    turn = {
        "_id": "u-1",
        "conversation_id": "c-usage",
        "created_at": MESSY_START,
        "user_message": "hello",
        "token_usage": {"input_tokens": 5, "output_tokens": 0},
    }
    conversion = convert([turn])
    assert conversion.conversation is not None
    assert conversion.conversation.usage.input_tokens == 5
    [problem] = conversion.problems
    assert (problem.kind, problem.placed) == ("usage_without_response", True)


def test_token_usage_past_what_a_sum_holds_saturates_as_live_sums_do() -> None:
    """Each count is one a message keeps; their sum is not, and stops at 2**53 - 1."""
    turns = [
        {
            "_id": f"u-{n}",
            "conversation_id": "c-usage",
            "created_at": MESSY_START + timedelta(minutes=n),
            "user_message": "hello",
            "token_usage": {"input_tokens": 2**53 - 1, "output_tokens": 0},
        }
        for n in range(2)
    ]
    conversion = convert(turns)
    assert conversion.conversation is not None
    assert conversion.conversation.usage.input_tokens == 2**53 - 1


def usage_turn(token_usage: Any) -> dict[str, Any]:
    return {"_id": "u-1", "conversation_id": "c-usage", "created_at": MESSY_START,
            "user_message": "q", "response_parts": [{"type": "text", "content": "a"}],
            "token_usage": token_usage}  # fmt: skip


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 700, "completion_tokens": 90},
        {"request_tokens": 700, "response_tokens": 90, "details": {}},
        {"input_tokens": None, "request_tokens": 700, "output_tokens": "", "completion_tokens": 90},
        {"prompt_tokens": 700, "completion_tokens": 90, "total_tokens": 790},
    ],
    ids=["openai", "pydantic-ai", "a missing spelling", "a total that sums them"],
)
def test_token_usage_in_each_common_spelling_is_read(usage: dict[str, Any]) -> None:
    conversion = convert([usage_turn(usage)])

    [answer] = [m for m in conversion.messages if m.role == "assistant"]
    assert answer.token_usage is not None
    assert (answer.token_usage.input_tokens, answer.token_usage.output_tokens) == (700, 90)
    assert conversion.conversation is not None
    assert conversion.conversation.usage.input_tokens == 700
    assert conversion.problems == []


@pytest.mark.parametrize(
    ("usage", "kind", "content"),
    [
        (
            {"input_tokens": 7, "output_tokens": 1, "cached_tokens": 5, "details": {"r": 2}},
            "unread_field",
            {"cached_tokens": 5, "details": {"r": 2}},
        ),
        ({"total_tokens": 790}, "unread_field", {"total_tokens": 790}),
        (
            {"input_tokens": 7, "output_tokens": 1, "total_tokens": 9},
            "unread_field",
            {"total_tokens": 9},
        ),
        (
            {"input_tokens": 7, "prompt_tokens": 8, "output_tokens": 1},
            "unread_spelling",
            {"prompt_tokens": 8},
        ),
    ],
    ids=["other keys", "a total alone", "a total that does not sum them", "two spellings"],
)
def test_token_usage_the_converter_does_not_read_is_kept_in_a_problem(
    usage: dict[str, Any], kind: str, content: dict[str, Any]
) -> None:
    conversion = convert([usage_turn(usage)])

    assert [(p.kind, p.field, p.placed, p.content) for p in conversion.problems] == [
        (kind, "token_usage", False, content)
    ]


def test_an_unreadable_spelling_of_token_usage_is_a_problem_beside_a_readable_one() -> None:
    usage = {"input_tokens": "n/a", "prompt_tokens": 700, "output_tokens": 90}
    conversion = convert([usage_turn(usage)])

    [answer] = [m for m in conversion.messages if m.role == "assistant"]
    assert answer.token_usage is not None
    assert answer.token_usage.input_tokens == 700
    assert [(p.kind, p.field, p.content) for p in conversion.problems] == [
        ("unreadable_number", "token_usage", usage)
    ]


def test_response_text_that_no_message_holds_is_still_a_problem() -> None:
    turn = {
        "_id": "r-1",
        "conversation_id": "c-text",
        "created_at": MESSY_START,
        "user_message": "hello",
        "response_parts": [{"type": "text", "content": "one thing"}],
        "response_text": "something else entirely",
    }
    [problem] = convert([turn]).problems
    assert (problem.kind, problem.field, problem.placed) == (
        "response_text_not_in_parts",
        "response_text",
        False,
    )


def answer_turn(parts: list[str], response_text: str) -> dict[str, Any]:
    """A turn whose text parts are `parts`, summed up in `response_text`."""
    return {
        "_id": "r-1", "conversation_id": "c-text", "created_at": MESSY_START,
        "user_message": "which dose?", "response_text": response_text,
        "response_parts": [{"type": "text", "content": part} for part in parts],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("parts", "response_text"),
    [
        (["Take 1 0mg twice"], "Take 10mg twice"),
        (["Take 10mg twice"], "Take 1 0mg twice"),
        (["Take 10", "mg twice"], "Take 10 m g twice"),
        (["Take 10mg  twice"], "Take 10mg twice"),
        (["Take 10mg twice. Then", "rest"], "Take 10mg"),
        (["Hello.", "Take 10mg", "twice daily."], "Take 10mg twice"),
        (["Now checking the policy."], "No"),
        (["Let me check if you are eligible for a refund."], "you are eligible for a refund."),
        (["Take 10mg", "twice"], "10mg twice"),
        (["Take 10mg", "Hello.", "twice"], "Take 10mg twice"),
    ],
    ids=[
        "space-removed",
        "space-added",
        "across-parts",
        "spaced-otherwise",
        "a-part-cut-short",
        "within-parts",
        "a-parts-first-letters",
        "the-end-of-a-part",
        "a-part-cut-off",
        "parts-not-one-after-another",
    ],
)
def test_response_text_that_is_not_whole_parts_one_after_another_is_a_problem(
    parts: list[str], response_text: str
) -> None:
    """The answer is told by the parts only when it is one or more of their texts, whole, one
    after another: a piece of a text says something else (`No` is not `Now checking…`; "you
    are eligible" inside "Let me check if you are eligible" is no answer), and white space
    inside a text is content, as in a history's pieces: `10mg` is not `1 0mg`; only white
    space at the ends of a part, or between two, is aside."""
    [problem] = convert([answer_turn(parts, response_text)]).problems
    assert (problem.kind, problem.content) == ("response_text_not_in_parts", response_text)


@pytest.mark.parametrize(
    ("parts", "response_text"),
    [
        (["Take 10mg", "twice"], "Take 10mg twice"),
        (["Take 10mg ", "twice"], "Take 10mg\n\ntwice"),
        (["Take 10", "mg twice"], "Take 10mg twice"),
        (["Take 10mg twice"], " Take 10mg twice\n"),
        (["Hello.", "Take 10mg", "twice daily."], "Take 10mg"),
        (["Hello.", "Take 10mg", "twice daily."], "Take 10mg twice daily."),
    ],
    ids=[
        "joined-by-a-space",
        "joined-by-lines",
        "joined-without",
        "at-the-ends",
        "one-part",
        "the-last-parts",
    ],
)
def test_response_text_the_parts_hold_but_for_white_space_at_or_between_their_ends_is_no_problem(
    parts: list[str], response_text: str
) -> None:
    assert convert([answer_turn(parts, response_text)]).problems == []


def checked_turn(response_text: str) -> dict[str, Any]:
    """A turn saying something, calling a tool, then answering; summed up in `response_text`."""
    return {
        "_id": "r-1", "conversation_id": "c-text", "created_at": MESSY_START,
        "user_message": "Am I eligible for a refund?", "response_text": response_text,
        "response_parts": [
            {"type": "text", "content": "Let me check if you are eligible for a refund."},
            {"type": "tool_call", "tool_name": "refund", "args": {}, "tool_call_id": "c1"},
            {"type": "tool_result", "tool_name": "refund", "result": "no", "tool_call_id": "c1"},
            {"type": "text", "content": "Sorry,"},
            {"type": "text", "content": "you are not eligible."},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    "response_text",
    [
        "Sorry, you are not eligible.",
        "Let me check if you are eligible for a refund.Sorry,you are not eligible.",
        "you are not eligible.",
    ],
    ids=["the-texts-after-the-tool-round", "every-text-joined", "the-last-text"],
)
def test_response_text_that_is_texts_of_the_turn_one_after_another_is_held_across_tool_rounds(
    response_text: str,
) -> None:
    """The final answer after the last tool round, or every text of the turn joined (as the
    dual write sums a turn up): its texts one after another, the tool round between aside."""
    assert convert([checked_turn(response_text)]).problems == []


@pytest.mark.parametrize(
    "response_text",
    ["Checking.Shall I book the 8:04?", "Checking.Booked.", "Shall I book the 8:04?"],
    ids=["texts-and-the-prompt", "the-texts-alone", "the-prompt"],
)
def test_response_text_summing_up_a_turn_with_a_hitl_prompt_is_held(response_text: str) -> None:
    """What the turn said one after another, its HITL prompt too, or its texts alone (the
    dual write joins a turn's text parts, leaving its prompts out)."""
    turn = {
        "_id": "r-1", "conversation_id": "c-text", "created_at": MESSY_START,
        "user_message": "book it", "response_text": response_text,
        "response_parts": [
            {"type": "text", "content": "Checking."},
            {"type": "hitl", "action": "confirm", "params": {}, "request_id": "r-1",
             "prompt": "Shall I book the 8:04?"},
            {"type": "text", "content": "Booked."},
        ],
    }  # fmt: skip
    assert convert([turn]).problems == []


@pytest.mark.parametrize(
    "response_text", ["you are eligible for a refund.", "No", "Sorry, you are"]
)
def test_response_text_that_only_a_piece_of_a_text_holds_is_kept_in_a_problem(
    response_text: str,
) -> None:
    """A final answer whose words lie within a text of the turn (or begin one) says something
    else than that text: no message holds it, so a problem not placed keeps it, and the drop
    of the legacy turns waits on it."""
    [problem] = convert([checked_turn(response_text)]).problems
    assert (problem.kind, problem.field, problem.placed, problem.content) == (
        "response_text_not_in_parts",
        "response_text",
        False,
        response_text,
    )


TWO_SPELLINGS = {
    "text and content": ({"type": "text", "content": "shown", "text": "«second»"}, ["text"]),
    "result and content": (
        {"type": "tool_result", "tool_name": "f", "result": "4", "content": "«sum»"},
        ["content"],
    ),
    "prompt and content": (
        {"type": "hitl", "action": "pay", "prompt": "Pay?", "content": "«terms»"},
        ["content"],
    ),
    "message, error and content": (
        {"type": "error", "message": "boom", "error": "«trace»", "content": "«more»"},
        ["error", "content"],
    ),
    "name and tool_name": (
        {"type": "tool_call", "tool_name": "f", "name": "«g»", "args": {}},
        ["name"],
    ),
    "type and part_kind": (
        {"type": "text", "part_kind": "error", "content": "Payment failed: card declined"},
        ["part_kind"],
    ),
    "type and part_kind of an upload": (
        {"type": "file_upload", "part_kind": "text", "filename": "a.pdf"},
        ["part_kind"],
    ),
}


@pytest.mark.parametrize(("part", "unread"), TWO_SPELLINGS.values(), ids=list(TWO_SPELLINGS))
def test_a_part_spelling_a_field_twice_with_two_values_keeps_the_unread_one_in_a_problem(
    part: dict[str, Any], unread: list[str]
) -> None:
    """The converter reads one spelling; another holding something else is never dropped
    silently: an unplaced problem holds it, so the gate asks an operator to accept it."""
    turn = {"_id": "s-1", "conversation_id": "c-spell", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [part]}  # fmt: skip
    problems = [p for p in convert([turn]).problems if p.kind == "unread_spelling"]

    assert [(p.field, p.placed, p.content) for p in problems] == [
        ("response_parts.0", False, {name: part[name] for name in unread})
    ]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "content": "same", "text": "same"},
        {"type": "tool_call", "tool_name": "f", "args": {"q": 1}, "arguments": '{"q": 1}'},
        {"type": "tool_result", "tool_name": "f", "result": {"n": 2}, "content": '{"n":2}'},
        {"type": "tool-return", "part_kind": "tool_result", "tool_name": "f", "result": 1},
    ],
    ids=["text", "arguments as JSON text", "result as JSON text", "kind in two spellings"],
)
def test_two_spellings_saying_the_same_are_no_problem(part: dict[str, Any]) -> None:
    turn = {"_id": "s-1", "conversation_id": "c-spell", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [part]}  # fmt: skip
    assert [p.kind for p in convert([turn]).problems if p.kind == "unread_spelling"] == []


@pytest.mark.parametrize(
    ("read", "other"),
    [
        (1, True),
        (0, False),
        ('{"v": 1e999}', '{"v": 2e999}'),
        ("[0.1]", "[0.10000000000000001]"),
        ('{"m": "kept"}', '{"m": "«only here»", "m": "kept"}'),
    ],
    ids=["1 and true", "0 and false", "huge numbers", "digits a double loses", "a key twice"],
)
def test_values_python_calls_equal_are_still_two_values(read: Any, other: Any) -> None:
    part = {"type": "tool_result", "tool_name": "f", "result": read, "content": other}
    turn = {"_id": "s-1", "conversation_id": "c-spell", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [part]}  # fmt: skip
    [problem] = [p for p in convert([turn]).problems if p.kind == "unread_spelling"]
    assert problem.content == {"content": other}


UNREAD_FIELDS = {
    "hitl options": (
        {"response_parts": [{"type": "hitl", "action": "pick", "request_id": "r-1",
                             "prompt": "Which?", "options": ["«AF 1234»", "«LH 99»"]}]},
        "response_parts.0", {"options": ["«AF 1234»", "«LH 99»"]},
    ),
    "error code": (
        {"response_parts": [{"type": "error", "message": "failed", "code": "«declined»"}]},
        "response_parts.0", {"code": "«declined»"},
    ),
    "text annotations": (
        {"response_parts": [{"part_kind": "text", "content": "See.", "annotations": ["«a»"]}]},
        "response_parts.0", {"annotations": ["«a»"]},
    ),
    "turn feedback": (
        {"feedback": {"rating": -1, "comment": "«wrong»"}}, "feedback",
        {"rating": -1, "comment": "«wrong»"},
    ),
    # the dual write's own fields, read on a dual-written turn (`dual_write: true`) alone
    "an old service's turn id": ({"turn_id": "«OLD-7f3a»"}, "turn_id", "«OLD-7f3a»"),
    "a dual_write that is no mark": ({"dual_write": "«flag»"}, "dual_write", "«flag»"),
    "a digest field on an old turn": (
        {"dual_write_exact": "«5b2d»"}, "dual_write_exact", "«5b2d»",
    ),
    "whole texts on an old turn": (
        {"dual_write_whole_texts": ["«3e8f»"]}, "dual_write_whole_texts", ["«3e8f»"],
    ),
}  # fmt: skip


@pytest.mark.parametrize(("fields", "where", "content"), UNREAD_FIELDS.values(),
                         ids=list(UNREAD_FIELDS))  # fmt: skip
def test_a_field_no_reader_takes_is_kept_in_a_problem(
    fields: dict[str, Any], where: str, content: Any
) -> None:
    """A part or a turn holding a field the converter does not read: an unplaced problem
    holds it, so the gate asks an operator to accept it."""
    turn = {"_id": "u-1", "conversation_id": "c-unread", "created_at": MESSY_START,
            "user_message": "hi", **fields}  # fmt: skip
    problems = convert([turn]).problems

    assert [(p.kind, p.field, p.placed, p.content) for p in problems] == [
        ("unread_field", where, False, content)
    ]


def test_every_field_of_the_corpora_and_the_dual_write_is_read() -> None:
    """Fields the legacy format names, every spelling the converter reads, and the fields
    the dual write adds are no problem."""
    from app.examples import example_legacy_turns
    from scripts.legacy_corpus import legacy_corpus
    from tests.test_legacy_spellings import spelled_turns

    example = convert(example_legacy_turns()).messages
    dual_written = legacy_turn_documents("c-dual", "t-1", example, user_id="u", name="n")
    corpora = [example_legacy_turns(), spelled_turns(), list(legacy_corpus(4, turns=3))]
    corpora += [dual_written]
    corpora += [[d for d in messy_corpus() if d["conversation_id"] == c]
                for c in {d["conversation_id"] for d in messy_corpus()}]  # fmt: skip
    found = [
        p
        for turns in corpora
        for group in group_conversations(parse_turns(turns)).values()
        for p in convert(group).problems
        if p.kind == "unread_field"
    ]
    assert found == []


def test_a_summed_up_call_no_part_holds_is_a_problem_holding_it() -> None:
    """`tool_calls` beside the parts summed them up; a call only it holds is kept in a
    problem (as `response_text` is), one a part holds (same tool, same arguments) is not."""
    held = {"tool_name": "lookup", "args": {"q": "x", "n": 1}}
    only_summed = {"tool_name": "refund", "args": {"order": "«77»"}}
    turn = {
        "_id": "s-1", "conversation_id": "c-sum", "created_at": MESSY_START,
        "user_message": "hi",
        "response_parts": [{"type": "tool_call", "tool_name": "lookup", "args": '{"n":1,"q":"x"}'}],
        "tool_calls": [held, only_summed],
    }  # fmt: skip
    problems = [p for p in convert([turn]).problems if p.field == "tool_calls"]

    assert [(p.kind, p.placed, p.content) for p in problems] == [
        ("tool_call_not_in_parts", False, only_summed)
    ]


@pytest.mark.parametrize(
    "summed",
    [
        {"tool_name": "lookup"},
        {"tool_name": "lookup", "args": {"n": 1.0}},
        {"tool_name": "lookup", "args": '{"n": 1.00}'},
        {"type": "function", "function": {"name": "lookup", "arguments": '{"n": 1}'}},
    ],
    ids=["the tool only", "1.0 for 1", "1.00 in text", "the OpenAI shape"],
)
def test_a_summed_up_call_a_part_holds_is_no_problem(summed: dict[str, Any]) -> None:
    turn = {
        "_id": "s-1", "conversation_id": "c-sum", "created_at": MESSY_START,
        "user_message": "hi",
        "response_parts": [{"type": "tool_call", "tool_name": "lookup", "args": {"n": 1}}],
        "tool_calls": [summed],
    }  # fmt: skip
    assert [p for p in convert([turn]).problems if p.field == "tool_calls"] == []


def test_each_problem_names_the_field_it_concerns() -> None:
    conversion = convert(conversation("mess-odd-values"))
    fields = {(p.kind, p.field, p.part_index) for p in conversion.problems}
    assert fields == {("invalid_part", "response_parts", None)}


async def test_deleting_a_conversation_migrated_under_a_derived_id_reaches_its_legacy_turns(
    backend: Backend,
) -> None:
    orphan_turn = {"_id": "lost-1", "user_message": "where am I?", "created_at": MESSY_START}
    documents = [*conversation(NOT_AN_IDENTIFIER), orphan_turn]
    await backend.db[LEGACY_TURNS].insert_many([dict(d) for d in documents])
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))
    for group in group_conversations(parse_turns(documents)).values():
        conversion = convert(group)  # as the migration stores it
        assert conversion.conversation is not None
        await backend.db[CONVERSATIONS].insert_one(
            conversion.conversation.model_dump(by_alias=True)
        )
        await backend.db[MESSAGES].insert_many(
            [m.model_dump(by_alias=True) for m in conversion.messages]
        )

    deleted = await store.delete(derived_conversation_id(NOT_AN_IDENTIFIER))
    assert (deleted.legacy_turns, deleted.messages) == (2, 4)
    orphan = derived_conversation_id(None, turn_key="lost-1")
    assert (await store.delete(orphan)).legacy_turns == 1
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 0


def test_a_summed_up_call_with_true_for_1_is_not_held_by_its_part() -> None:
    turn = {
        "_id": "s-1", "conversation_id": "c-sum", "created_at": MESSY_START,
        "user_message": "hi",
        "response_parts": [{"type": "tool_call", "tool_name": "lookup", "args": {"n": 1}}],
        "tool_calls": [{"tool_name": "lookup", "args": {"n": True}}],
    }  # fmt: skip
    problems = [p.kind for p in convert([turn]).problems if p.field == "tool_calls"]
    assert problems == ["tool_call_not_in_parts"]


def one_turn(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"_id": "i-1", "conversation_id": "c-ids", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": list(parts)}  # fmt: skip


def test_a_tool_call_id_or_request_id_stored_as_a_number_is_read_as_its_text() -> None:
    conversion = convert([one_turn(
        {"type": "tool_call", "tool_name": "f", "args": {}, "tool_call_id": 987654},
        {"type": "tool_result", "tool_name": "f", "result": "ok", "tool_call_id": 987654},
        {"type": "hitl", "action": "pay", "prompt": "Pay?", "request_id": 4711},
    )])  # fmt: skip
    _, call, result, hitl = conversion.messages

    assert [c.id for c in call.tool_calls or ()] == ["987654"]
    assert result.tool_call_id == "987654"
    assert hitl.hitl_action is not None
    assert hitl.hitl_action.request_id == "4711"
    assert conversion.problems == []


@pytest.mark.parametrize(
    "part",
    [
        {"type": "tool_call", "tool_name": "f", "args": {}, "tool_call_id": "«c»" * 70},
        {"type": "hitl", "action": "pay", "prompt": "Pay?", "request_id": "«r»" * 70},
    ],
    ids=["tool call id", "request id"],
)
def test_an_id_no_message_can_hold_is_replaced_and_kept_in_a_placed_problem(
    part: dict[str, Any],
) -> None:
    """A message holds ids of 1 to 200 characters: a longer one gets a generated id, and
    the problem keeps the one found."""
    conversion = convert([one_turn(part)])
    found = part.get("tool_call_id", part.get("request_id"))

    assert [(p.kind, p.placed, p.part_index, p.content) for p in conversion.problems] == [
        ("replaced_id", True, 0, found)
    ]
    assert found not in conversion.messages[-1].model_dump_json()


def test_the_bookkeeping_of_a_part_in_pydantic_ais_shape_is_no_problem() -> None:
    """When and by which provider a part was made says nothing the transcript shows."""
    part = {"part_kind": "tool-return", "tool_name": "f", "tool_call_id": "c1",
            "content": "ok", "timestamp": "2024-03-01T12:00:00Z", "id": "p-1",
            "provider_details": {"x": 1}, "provider_name": "openai"}  # fmt: skip
    turn = {"_id": "u-2", "conversation_id": "c-pai", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [part]}  # fmt: skip

    assert [p.kind for p in convert([turn]).problems if p.kind == "unread_field"] == []


def history(*requests: dict[str, Any]) -> str:
    """Pydantic AI messages as JSON: each request followed by a text answer."""
    answer = {"kind": "response", "parts": [{"part_kind": "text", "content": "an answer"}]}
    return json.dumps([m for r in requests for m in ({"kind": "request", **r}, answer)])


def test_a_system_prompt_only_the_message_history_holds_is_kept_in_a_problem() -> None:
    """The history repeats the conversation so far: a system prompt or instructions it holds
    that no system message holds is kept once, in the first turn holding it."""
    asked = {"parts": [{"part_kind": "system-prompt", "content": "You are «refund-policy»"},
                       {"part_kind": "user-prompt", "content": "question 1"}],
             "instructions": "«Be brief»"}  # fmt: skip
    turns = [
        {"_id": f"h-{n}", "conversation_id": "c-h", "created_at": MESSY_START,
         "user_message": f"question {n}", "response_text": "an answer",
         "message_history_json": history(asked)}
        for n in (1, 2)
    ]  # fmt: skip
    problems = convert(turns).problems

    assert [(p.kind, p.legacy_id, p.field, p.placed, p.content) for p in problems] == [
        ("system_prompt_only_in_history", "h-1", "message_history_json", False,
         "You are «refund-policy»"),
        ("system_prompt_only_in_history", "h-1", "message_history_json", False, "«Be brief»"),
    ]  # fmt: skip


def test_a_system_prompt_a_system_turn_holds_is_no_problem_in_the_history() -> None:
    asked = {"parts": [{"part_kind": "system-prompt", "content": "You are «refund-policy»"}]}
    turns = [
        {"_id": "s-0", "conversation_id": "c-h", "created_at": MESSY_START, "is_system": True,
         "user_message": "You are «refund-policy»"},
        {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
         "user_message": "question", "response_text": "an answer",
         "message_history_json": history(asked)},
    ]  # fmt: skip
    assert convert(turns).problems == []


def test_a_turn_that_converts_to_no_message_keeps_its_history_in_a_problem() -> None:
    """DESIGN §4: the converter never drops content silently. A turn holding only its
    `message_history_json` converts to no message: the history is all that says what was
    said in it, kept whole in an unplaced problem; an empty history is no problem."""
    said = history({"parts": [{"part_kind": "user-prompt", "content": "book «LH401»"}]})
    turns = [
        {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
         "user_message": "question"},
        {"_id": "h-2", "conversation_id": "c-h", "created_at": MESSY_START,
         "message_history_json": said},
        {"_id": "h-3", "conversation_id": "c-h", "created_at": MESSY_START,
         "message_history_json": "[]"},
    ]  # fmt: skip
    problems = convert(turns).problems

    assert [(p.kind, p.legacy_id, p.field, p.placed, p.content) for p in problems] == [
        ("turn_only_in_history", "h-2", "message_history_json", False, said)
    ]


UNHOLDABLE_PARAMS = {
    "a key with NUL": '{"a\\u0000b": "«9000 EUR»"}',
    "a lone surrogate": '{"amount": "\\ud800«9000 EUR»"}',
}


@pytest.mark.parametrize("text", UNHOLDABLE_PARAMS.values(), ids=list(UNHOLDABLE_PARAMS))
def test_json_text_params_a_message_cannot_hold_stay_text(text: str) -> None:
    """Params read from JSON text become the object only when a message can hold it (and
    a pending prompt's too): else the text is kept under `value`, and the part is placed."""
    part = {"type": "hitl", "action": "pay", "params": text, "request_id": "r-1",
            "prompt": "Pay?"}  # fmt: skip
    turn = {"_id": "t-a", "conversation_id": "c-a", "created_at": MESSY_START,
            "user_message": "q", "response_parts": [part]}  # fmt: skip
    prompt = {"conversation_id": "c-a", "request_id": "r-1", "action": "pay",
              "status": "pending", "params": text}  # fmt: skip

    conversion = with_session_prompts(convert([turn]), [prompt])

    assert [p.kind for p in conversion.problems] == []
    action = conversion.messages[-1].hitl_action
    assert action is not None
    assert action.params == {"value": text}
    assert conversion.conversation is not None
    pending = conversion.conversation.pending_hitl
    assert pending is not None
    assert pending.params == {"value": text}


def test_a_system_prompt_cut_to_the_message_bound_is_held_by_its_system_message() -> None:
    big = "«system»" + "S" * 1_200_000
    history = json.dumps([{"kind": "request", "parts": [
        {"part_kind": "system-prompt", "content": big},
        {"part_kind": "user-prompt", "content": "q"}]}])  # fmt: skip
    system = {"_id": "t-0", "conversation_id": "c-a", "created_at": MESSY_START,
              "user_message": big, "is_system": True}  # fmt: skip
    turn = {"_id": "t-a", "conversation_id": "c-a", "created_at": MESSY_START + timedelta(hours=1),
            "user_message": "q", "response_parts": [{"type": "text", "content": "hi"}],
            "message_history_json": history}  # fmt: skip

    conversion = convert([system, turn])

    assert conversion.messages[0].truncated  # the system message holds it, cut
    assert [p.kind for p in conversion.problems if not p.placed] == []


@pytest.mark.parametrize("part", [
    {"type": "hitl", "id": "«req-7»", "action": "pay", "prompt": "Pay?", "params": {}},
    {"type": "error", "message": "boom", "provider_details": {"trace": "«trace-only»"}},
], ids=["a hitl part's id", "an error part's provider details"])  # fmt: skip
def test_bookkeeping_names_are_read_only_on_the_parts_pydantic_ai_writes(
    part: dict[str, Any],
) -> None:
    turn = {"_id": "t-a", "conversation_id": "c-a", "created_at": MESSY_START,
            "user_message": "q", "response_parts": [part]}  # fmt: skip

    assert [p.kind for p in convert([turn]).problems if not p.placed] == ["unread_field"]


HIDDEN = "[RUNTIME CONTEXT] «ctx-marker» account tier: gold [/RUNTIME CONTEXT]"


@pytest.mark.parametrize(
    ("said", "shown", "hidden"),
    [
        (f"{HIDDEN} hello", "hello", HIDDEN),
        (HIDDEN, "", HIDDEN),
        (
            "Hi [RUNTIME CONTEXT]a[/RUNTIME CONTEXT] there [RUNTIME CONTEXT]b[/RUNTIME CONTEXT]",
            "Hi  there",
            "[RUNTIME CONTEXT]a[/RUNTIME CONTEXT][RUNTIME CONTEXT]b[/RUNTIME CONTEXT]",
        ),
    ],
    ids=["before-the-text", "the-whole-message", "two-blocks"],
)
def test_runtime_context_a_legacy_user_message_held_is_kept_in_an_unplaced_problem(
    said: str, shown: str, hidden: str
) -> None:
    """DESIGN §3: only what the user saw is stored; DESIGN §4: the converter never drops
    content silently. What is stripped from the user's message is kept, as it was written,
    in a `hidden_runtime_context` problem no message holds."""
    answer = [{"type": "text", "content": "hi"}]
    turn = {"_id": "t-1", "conversation_id": "c-ctx", "created_at": MESSY_START,
            "user_message": said, "response_parts": answer}  # fmt: skip
    conversion = convert([turn])

    assert [(m.role, m.content) for m in conversion.messages] == [
        ("user", shown),
        ("assistant", "hi"),
    ]
    assert [(p.kind, p.legacy_id, p.field, p.placed, p.content) for p in conversion.problems] == [
        ("hidden_runtime_context", "t-1", "user_message", False, hidden)
    ]


def _turn_with_upload(upload: dict[str, Any], where: str) -> dict[str, Any]:
    """A legacy turn holding `upload` as its `upload_result`, or as its first response part
    (`where` "response_parts"), before an answer."""
    answer: list[dict[str, Any]] = [{"type": "text", "content": "hi"}]
    turn = {"_id": "t-1", "conversation_id": "c-ctx", "created_at": MESSY_START,
            "user_message": "see", "response_parts": answer}  # fmt: skip
    if where == "upload_result":
        turn["upload_result"] = upload
    else:
        answer.insert(0, {"type": "file_upload", **upload})
    return turn


@pytest.mark.parametrize("where", ["upload_result", "response_parts"])
def test_runtime_context_a_legacy_uploads_parsed_text_held_is_kept_in_an_unplaced_problem(
    where: str,
) -> None:
    """An upload's parsed text is text of the user's message too: it keeps what the user
    saw, and what is stripped is kept, as written, in a `hidden_runtime_context` problem;
    the transcript `verify` compares leaves it out of the legacy side as well."""
    upload = {"filename": "a.txt", "file_type": "text/plain", "size": 3,
              "parsed_text": f"{HIDDEN} file text"}  # fmt: skip
    turn = _turn_with_upload(upload, where)
    conversion = convert([turn])

    uploads = [m.upload for m in conversion.messages if m.upload is not None]
    assert [u.parsed_text for u in uploads] == ["file text"]
    index = None if where == "upload_result" else 0
    assert [(p.kind, p.field, p.part_index, p.placed, p.content) for p in conversion.problems] == [
        ("hidden_runtime_context", where, index, False, HIDDEN)
    ]
    legacy = from_legacy(parse_turns([turn]), conversion.problems)
    assert legacy.lines == from_messages(conversion.messages).lines


@pytest.mark.parametrize("where", ["upload_result", "response_parts"])
def test_runtime_context_a_legacy_uploads_file_name_held_is_kept_in_an_unplaced_problem(
    where: str,
) -> None:
    """Every text of an upload is text of the user's message (its file name and type too,
    not only its parsed text): the upload keeps what the user saw, each text's stripped
    context is kept, as written, in a `hidden_runtime_context` problem naming the field, and
    the transcript `verify` compares leaves it out of the legacy side as well."""
    upload = {"filename": f"report{HIDDEN}.pdf", "file_type": f"{HIDDEN}application/pdf",
              "size": 3, "parsed_text": "file text"}  # fmt: skip
    turn = _turn_with_upload(upload, where)
    conversion = convert([turn])

    uploads = [m.upload for m in conversion.messages if m.upload is not None]
    assert [(u.filename, u.file_type, u.parsed_text) for u in uploads] == [
        ("report.pdf", "application/pdf", "file text")
    ]
    stored = [m.model_dump(mode="json") for m in conversion.messages]
    assert "«ctx-marker»" not in json.dumps(stored, ensure_ascii=False)
    index = None if where == "upload_result" else 0
    assert [(p.kind, p.field, p.part_index, p.placed, p.content) for p in conversion.problems] == [
        ("hidden_runtime_context", where, index, False, HIDDEN),
        ("hidden_runtime_context", where, index, False, HIDDEN),
    ]
    assert ["filename" in p.detail for p in conversion.problems] == [True, False]
    legacy = from_legacy(parse_turns([turn]), conversion.problems)
    assert legacy.lines == from_messages(conversion.messages).lines


def test_runtime_context_markers_in_a_system_turn_are_no_problem() -> None:
    """A system turn is stored as it was written: nothing is stripped from it."""
    turn = {"_id": "s-1", "conversation_id": "c-ctx", "created_at": MESSY_START,
            "is_system": True, "user_message": HIDDEN}  # fmt: skip
    conversion = convert([turn])

    assert [m.content for m in conversion.messages] == [HIDDEN]
    assert conversion.problems == []


def test_a_result_naming_another_tool_than_its_call_keeps_its_name_in_a_placed_problem() -> None:
    """A result answers the call its id names; the tool it names itself, when another, is no
    message's: a placed problem keeps the result whole, so the name outlives the drop."""
    result = {"type": "tool_result", "tool_name": "«delete_account»", "result": "ok",
              "tool_call_id": "a"}  # fmt: skip
    turn = {"_id": "r-1", "conversation_id": "c-rname", "created_at": MESSY_START,
            "user_message": "hi",
            "response_parts": [{"type": "tool_call", "tool_name": "search", "args": {},
                                "tool_call_id": "a"}, result]}  # fmt: skip
    conversion = convert([turn])

    assert [(m.role, m.tool_call_id, m.content) for m in conversion.messages[1:]] == [
        ("assistant", None, None),
        ("tool", "a", "ok"),
    ]
    assert [(p.kind, p.field, p.part_index, p.placed, p.content) for p in conversion.problems] == [
        ("mismatched_tool_name", "response_parts", 1, True, result)
    ]


@pytest.mark.parametrize(
    "result",
    [
        {"type": "tool_result", "tool_name": "search", "result": "ok", "tool_call_id": "a"},
        {"type": "tool_result", "result": "ok", "tool_call_id": "a"},
    ],
    ids=["the call's tool", "no tool (the OpenAI way)"],
)
def test_a_result_naming_its_calls_tool_or_none_is_no_problem(result: dict[str, Any]) -> None:
    turn = {"_id": "r-1", "conversation_id": "c-rname", "created_at": MESSY_START,
            "user_message": "hi",
            "response_parts": [{"type": "tool_call", "tool_name": "search", "args": {},
                                "tool_call_id": "a"}, result]}  # fmt: skip
    assert convert([turn]).problems == []


SUMMED_WITH_MORE = {"tool_name": "search", "args": {"q": 1}, "status": "«FAILED»",
                    "result": "«3 hits»"}  # fmt: skip


@pytest.mark.parametrize(
    ("parts", "where"),
    [
        ([{"type": "tool_call", "tool_name": "search", "args": {"q": 1}}], "tool_calls"),
        (None, "response_parts.-1"),
    ],
    ids=["beside a part holding the call", "on a turn without parts"],
)
def test_a_summed_up_calls_fields_no_message_holds_are_kept_whether_or_not_parts_exist(
    parts: list[dict[str, Any]] | None, where: str
) -> None:
    """One rule for a `tool_calls` entry: its fields no message holds are an unplaced
    `unread_field` problem, whether the call is converted from it or from a part."""
    turn = {"_id": "s-1", "conversation_id": "c-sum", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": parts,
            "tool_calls": [SUMMED_WITH_MORE]}  # fmt: skip
    problems = convert([turn]).problems

    assert [(p.kind, p.field, p.placed, p.content) for p in problems] == [
        ("unread_field", where, False, {"status": "«FAILED»", "result": "«3 hits»"})
    ]


@pytest.mark.parametrize(
    ("part_id", "problems"),
    [
        (None, [("unread_field", {"id": "«call-9»"})]),
        ("other", [("unread_field", {"id": "«call-9»"})]),
        ("«call-9»", []),
    ],
    ids=["a part without an id", "a part of another id", "a part of that id"],
)
def test_a_summed_up_calls_id_beside_parts_is_kept_unless_a_message_holds_it(
    part_id: str | None, problems: list[tuple[str, Any]]
) -> None:
    part = {"type": "tool_call", "tool_name": "search", "args": {}, "tool_call_id": part_id}
    turn = {"_id": "s-1", "conversation_id": "c-sum", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [part],
            "tool_calls": [{"id": "«call-9»", "type": "function",
                            "function": {"name": "search", "arguments": "{}"}}]}  # fmt: skip
    assert [(p.kind, p.content) for p in convert([turn]).problems] == problems


def test_a_conversation_id_stored_as_bson_code_is_no_text_id_and_gets_a_derived_one() -> None:
    """`Code` is a `str` to Python, but JavaScript code to BSON: named by its extended JSON,
    scope included, so it never merges with the text id it spells."""
    code = Code("c-1", {"n": 1})
    turn = {"_id": "k-1", "conversation_id": code, "created_at": MESSY_START, "user_message": "hi"}
    conversion = convert([turn])

    named = '{"$code": "c-1", "$scope": {"n": 1}}'
    assert (id_text(code), named_id(code)) == (named, named)
    assert conversion.conversation_id == derived_conversation_id(named)
    assert [(p.kind, p.placed, p.content) for p in conversion.problems] == [
        ("derived_conversation_id", True, named)
    ]


@pytest.mark.parametrize(
    ("values", "named"),
    [([42, 42.0, Int64(42), bson.Decimal128("42"), bson.Decimal128("42.0"),
       bson.Decimal128("4.2E+1"), "42"], "42"),
     ([-0.0, 0, bson.Decimal128("-0")], "0"),
     ([42.5, bson.Decimal128("42.50")], "42.5"),
     ([1e16, Int64(10**16), bson.Decimal128("1E+16")], "10000000000000000")],
    ids=["42", "zero", "a fraction", "a double an integer is"],
)  # fmt: skip
def test_numbers_equal_by_value_name_one_conversation(values: list[Any], named: str) -> None:
    """The old service found a conversation's turns by an equality query, which matches a
    number by value whatever its BSON type (`42 == 42.0 == Decimal128("42.0")`): each names
    one conversation, by one text, and the filter of its turns finds every one of them."""
    assert {named_id(value) for value in values} == {named}
    turns = [{"_id": f"n-{n}", "conversation_id": value, "created_at": MESSY_START,
              "user_message": f"turn {n}"} for n, value in enumerate(values)]  # fmt: skip
    [conversion] = [convert(group) for group in group_conversations(parse_turns(turns)).values()]
    assert conversion.conversation_id == named
    assert conversion.problems == []


@pytest.mark.parametrize(
    "value", [0.1, bson.Decimal128("0.1"), bson.Decimal128("NaN"), float("inf")]
)
def test_a_number_no_other_type_holds_the_value_of_keeps_its_own_name(value: Any) -> None:
    """0.1 as a double is not the decimal 0.1 (a query tells them apart too)."""
    assert named_id(value) == id_text(value)


ALIKE_SPELLINGS = {
    "text": {"type": "text", "content": '{"b": 1, "a": 2}', "text": '{"a":2.0,"b":1}'},
    "arguments": {"type": "tool_call", "tool_name": "f", "args": '{"q": [1, 2]}',
                  "arguments": '{"q":[1.0,2]}'},
    "result": {"type": "tool_result", "tool_name": "f", "result": '{"n": 2}',
               "content": '{"n":2.00}'},
}  # fmt: skip


@pytest.mark.parametrize("part", ALIKE_SPELLINGS.values(), ids=list(ALIKE_SPELLINGS))
def test_a_second_text_saying_the_same_in_other_characters_is_kept_in_a_placed_problem(
    part: dict[str, Any],
) -> None:
    """Only exactly equal texts are one: a spelling `said` reads alike but written otherwise
    is no message's text, so a placed problem keeps it (the meaning is converted)."""
    call = {"type": "tool_call", "tool_name": "f", "args": {}}
    turn = {"_id": "s-1", "conversation_id": "c-spell", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [part, call]}  # fmt: skip
    other = next(name for name in ("text", "arguments", "content") if name in part)

    assert [(p.kind, p.field, p.placed, p.content) for p in convert([turn]).problems] == [
        ("equivalent_spelling", "response_parts.0", True, {other: part[other]})
    ]


def test_a_history_that_is_not_json_is_kept_whole_in_its_placed_problem() -> None:
    history = "[ModelRequest(parts=[UserPromptPart(content='hi')])] " + "x" * 300 + " «TAIL»"
    turn = {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": "hi", "message_history_json": history}  # fmt: skip

    [problem] = convert([turn]).problems

    assert (problem.kind, problem.placed, problem.content) == ("unreadable_history", True, history)


ASKED = {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": "hi"}]}
ANSWERED = {"kind": "response", "parts": [{"part_kind": "text", "content": "hello"}]}
HISTORY_ONLY_PARTS = {
    "thinking": {"part_kind": "thinking", "content": "«thinking only here»", "signature": "s"},
    "a response text": {"part_kind": "text", "content": "«said only here»"},
    "a tool call": {"part_kind": "tool-call", "tool_name": "«lookup»", "args": {"q": 1},
                    "tool_call_id": "call_h"},
    "a tool call's arguments": {"part_kind": "tool-call", "tool_name": "f",
                                "args": {"q": "«other»"}, "tool_call_id": "call_f"},
    "a tool return": {"part_kind": "tool-return", "tool_name": "f", "content": "«returned»",
                      "tool_call_id": "call_f"},
    "a retry prompt": {"part_kind": "retry-prompt", "tool_name": "f",
                       "content": [{"msg": "«field required»"}], "tool_call_id": "call_f"},
    "a user prompt": {"part_kind": "user-prompt", "content": "«asked only here»"},
    "an image in a user prompt": {"part_kind": "user-prompt",
                                  "content": ["hi", {"kind": "image-url", "url": "«img»"}]},
    "a part of a kind no reader knows": {"part_kind": "builtin-tool-call",
                                         "tool_name": "web_search", "args": {"q": "«web»"}},
}  # fmt: skip


@pytest.mark.parametrize("part", HISTORY_ONLY_PARTS.values(), ids=list(HISTORY_ONLY_PARTS))
def test_every_piece_of_a_history_no_message_holds_is_kept_whole_in_a_placed_problem(
    part: dict[str, Any],
) -> None:
    """The history copies the conversation as the model saw it: whatever part of it no
    converted message holds is kept whole, in a placed problem (the messages are right)."""
    call = {"type": "tool_call", "tool_name": "f", "args": {"q": 1}, "tool_call_id": "call_f"}
    result = {"type": "tool_result", "tool_name": "f", "result": "ok", "tool_call_id": "call_f"}
    said = [ASKED, ANSWERED, {"kind": "response", "parts": [part]}]
    turn = {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [{"type": "text", "content": "hello"},
                                                     call, result],
            "message_history_json": json.dumps(said)}  # fmt: skip

    problems = convert([turn]).problems

    assert [(p.kind, p.legacy_id, p.field, p.placed, p.content) for p in problems] == [
        ("history_only_content", "h-1", "message_history_json", True, part)
    ]


HISTORY_PIECES_BSON_CANNOT_HOLD = {
    "a text escaping a lone surrogate": {"part_kind": "text", "content": "«lone \ud800»"},
    "thinking escaping a lone surrogate": {"part_kind": "thinking", "content": "«\udfff»"},
    "a key with NUL": {"part_kind": "text", "content": "«nul»", "no\u0000te": 1},
    "a number wider than 64 bits": {"part_kind": "text", "content": "«wide»", "n": 10**30},
}


@pytest.mark.parametrize(
    "part", HISTORY_PIECES_BSON_CANNOT_HOLD.values(), ids=list(HISTORY_PIECES_BSON_CANNOT_HOLD)
)
def test_a_history_piece_bson_cannot_hold_is_kept_as_the_json_text_spelling_it(
    part: dict[str, Any],
) -> None:
    """Only JSON text spells such a value (a lone surrogate is a `\\ud800` escape): a
    problem keeps the JSON text, as a message keeps a call's arguments or a prompt's params,
    and the problem can be stored."""
    said = [ASKED, ANSWERED, {"kind": "response", "parts": [part]}]
    turn = {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [{"type": "text", "content": "hello"}],
            "message_history_json": json.dumps(said)}  # fmt: skip

    [problem] = convert([turn]).problems

    assert (problem.kind, problem.placed) == ("history_only_content", True)
    assert isinstance(problem.content, str)
    assert json.loads(problem.content) == part
    bson.encode(problem.model_dump())


NOT_PYDANTIC_AI_MESSAGES = {
    "an OpenAI-style message": {"role": "user", "content": "«openai only»"},
    "parts that are no list": {"kind": "request",
                               "parts": {"part_kind": "user-prompt", "content": "«parts»"}},
    "instructions that are no text": {"kind": "request", "parts": [],
                                      "instructions": ["«instructions»"]},
    "a message field holding content": {"kind": "response", "parts": [],
                                        "note": "«a note»"},
    "a kind no reader knows": {"kind": "«summary»", "parts": []},
}  # fmt: skip


@pytest.mark.parametrize(
    "message", NOT_PYDANTIC_AI_MESSAGES.values(), ids=list(NOT_PYDANTIC_AI_MESSAGES)
)
def test_a_history_message_not_in_pydantic_ais_shape_is_kept_whole_in_a_placed_problem(
    message: dict[str, Any],
) -> None:
    """A message the reader cannot read as a Pydantic AI message is kept whole: what it says
    is nowhere the checks look."""
    turn = {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [{"type": "text", "content": "hello"}],
            "message_history_json": json.dumps([ASKED, ANSWERED, message])}  # fmt: skip

    problems = convert([turn]).problems

    assert [(p.kind, p.legacy_id, p.placed, p.content) for p in problems] == [
        ("history_only_content", "h-1", True, message)
    ]


FIELDS_BESIDE_WHAT_IS_READ = {
    "a user prompt": {"part_kind": "user-prompt", "content": "hi", "«note»": "x"},
    "a system prompt": {"part_kind": "system-prompt", "content": "be brief", "«note»": "x"},
    "a retry prompt": {"part_kind": "retry-prompt", "content": "hello", "«note»": "x"},
    "a text": {"part_kind": "text", "content": "hello", "«note»": "x"},
    "a tool return": {"part_kind": "tool-return", "tool_name": "f", "content": "ok",
                      "tool_call_id": "call_f", "metadata": {"«note»": "x"}},
}  # fmt: skip


@pytest.mark.parametrize(
    "part", FIELDS_BESIDE_WHAT_IS_READ.values(), ids=list(FIELDS_BESIDE_WHAT_IS_READ)
)
def test_a_history_part_holding_a_field_no_check_reads_is_kept_whole(
    part: dict[str, Any],
) -> None:
    call = {"type": "tool_call", "tool_name": "f", "args": {}, "tool_call_id": "call_f"}
    result = {"type": "tool_result", "tool_name": "f", "result": "ok", "tool_call_id": "call_f"}
    said = [ASKED, ANSWERED, {"kind": "request", "parts": [part]}]
    turns = [
        {"_id": "s-0", "conversation_id": "c-h", "created_at": MESSY_START, "is_system": True,
         "user_message": "be brief"},
        {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START + timedelta(hours=1),
         "user_message": "hi", "response_parts": [{"type": "text", "content": "hello"},
                                                  call, result],
         "message_history_json": json.dumps(said)},
    ]  # fmt: skip

    problems = convert(turns).problems

    assert [(p.kind, p.legacy_id, p.placed, p.content) for p in problems] == [
        ("history_only_content", "h-1", True, part)
    ]


def test_the_metadata_of_a_history_message_and_its_parts_is_no_problem() -> None:
    """When, by which model and provider, at what cost, under which ids: no conversation
    content (MIGRATION.md lists these keys)."""
    when = {"timestamp": "2024-03-01T12:00:00Z"}
    said = [
        {"kind": "request", "run_id": "r-1", "instructions": None, **when,
         "parts": [{"part_kind": "user-prompt", "content": "hi", **when}]},
        {"kind": "response", "model_name": "gpt-4o", "provider_name": "openai",
         "provider_details": {"finish_reason": "stop"}, "provider_response_id": "resp-1",
         "finish_reason": "stop", "run_id": "r-1", "metadata": None, **when,
         "usage": {"input_tokens": 3, "output_tokens": 1, "details": {}},
         "parts": [{"part_kind": "text", "content": "hello", "id": "p-1",
                    "provider_name": "openai", "provider_details": None}]},
    ]  # fmt: skip
    turn = {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": "hi", "response_parts": [{"type": "text", "content": "hello"}],
            "message_history_json": json.dumps(said)}  # fmt: skip

    assert convert([turn]).problems == []


def history_turn(user: str, parts: list[dict[str, Any]], said: list[Any]) -> dict[str, Any]:
    return {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": user, "response_parts": parts,
            "message_history_json": json.dumps(said)}  # fmt: skip


def test_white_space_inside_a_history_text_is_content() -> None:
    """Only white space at the ends is aside: `print(a b)` is not `print(ab)`."""
    asked = {"part_kind": "user-prompt", "content": " print(a b)\n"}
    turn = history_turn(
        "print(ab)", [{"type": "text", "content": "ok"}], [{"kind": "request", "parts": [asked]}]
    )

    assert [(p.kind, p.content) for p in convert([turn]).problems] == [
        ("history_only_content", asked)
    ]


def test_a_history_text_is_held_only_by_a_message_of_its_role() -> None:
    """A user prompt by a user's text, a response text by an assistant's: swapped, neither
    is held."""
    asked = {"part_kind": "user-prompt", "content": "«hello»"}
    answered = {"part_kind": "text", "content": "«hi»"}
    said = [{"kind": "request", "parts": [asked]}, {"kind": "response", "parts": [answered]}]
    turn = history_turn("«hi»", [{"type": "text", "content": "«hello»"}], said)

    assert [(p.kind, p.content) for p in convert([turn]).problems] == [
        ("history_only_content", asked),
        ("history_only_content", answered),
    ]


def test_a_history_tool_return_is_held_only_by_the_tool_message_answering_its_call() -> None:
    """By the call's id when the history names one, else by the tool's name: a user's text
    or another tool's result saying the same holds nothing."""
    call = {"type": "tool_call", "tool_name": "balance", "args": {}, "tool_call_id": "x"}
    result = {"type": "tool_result", "tool_name": "balance", "result": "17", "tool_call_id": "x"}
    other = {"type": "tool_call", "tool_name": "other", "args": {}, "tool_call_id": "y"}
    answer = {"type": "tool_result", "tool_name": "other", "result": "«9»", "tool_call_id": "y"}
    by_id = {
        "part_kind": "tool-return",
        "tool_name": "balance",
        "content": "«42»",
        "tool_call_id": "x",
    }
    by_name = {"part_kind": "tool-return", "tool_name": "balance", "content": "«9»"}
    held = {"part_kind": "tool-return", "tool_name": "other", "content": "«9»"}
    said = [{"kind": "request", "parts": [by_id, by_name, held]}]  # fmt: skip
    turn = history_turn("«42»", [call, result, other, answer], said)

    assert [(p.kind, p.content) for p in convert([turn]).problems] == [
        ("history_only_content", by_id),
        ("history_only_content", by_name),
    ]


def test_a_history_the_messages_hold_is_no_problem() -> None:
    """Every piece found in the converted messages, white space and JSON spelling aside:
    the user's text without its runtime context, answers, calls with their arguments,
    results, a HITL call, empty returns."""
    said = [
        {"kind": "request", "parts": [
            {"part_kind": "system-prompt", "content": "be brief"},
            {"part_kind": "user-prompt",
             "content": "[RUNTIME CONTEXT]tier: gold[/RUNTIME CONTEXT] book it"}]},
        {"kind": "response", "parts": [
            {"part_kind": "text", "content": "Looking\n"},
            {"part_kind": "tool-call", "tool_name": "f", "args": '{"b": 2, "a": 1}',
             "tool_call_id": "call_f"},
            {"part_kind": "tool-call", "tool_name": "confirm", "args": {"p": 1},
             "tool_call_id": "call_c"}]},
        {"kind": "request", "parts": [
            {"part_kind": "tool-return", "tool_name": "f", "content": {"x": [1, 2]},
             "tool_call_id": "call_f", "timestamp": "2024-01-01T00:00:00Z"},
            {"part_kind": "tool-return", "tool_name": "g", "content": [],
             "tool_call_id": "call_g"}]},
    ]  # fmt: skip
    turns = [
        {"_id": "s-0", "conversation_id": "c-h", "created_at": MESSY_START, "is_system": True,
         "user_message": "be brief"},
        {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START + timedelta(hours=1),
         "user_message": "[RUNTIME CONTEXT]tier: gold[/RUNTIME CONTEXT] book it",
         "response_parts": [
             {"type": "text", "content": "Looking"},
             {"type": "tool_call", "tool_name": "f", "args": {"a": 1, "b": 2},
              "tool_call_id": "call_f"},
             {"type": "tool_result", "tool_name": "f", "result": '{"x": [1,2]}',
              "tool_call_id": "call_f"},
             {"type": "hitl", "action": "confirm", "params": {"p": 1}, "request_id": "r-1",
              "prompt": "Confirm?"}],
         "message_history_json": json.dumps(said)},
    ]  # fmt: skip

    assert [p.kind for p in convert(turns).problems] == ["hidden_runtime_context"]


def test_history_content_repeated_by_later_turns_is_kept_once_on_the_first_turn() -> None:
    thinking = {"part_kind": "thinking", "content": "«pondering»"}
    turns = []
    said: list[dict[str, Any]] = []
    for n in range(3):
        said += [
            {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": f"q{n}"}]},
            {"kind": "response", "parts": [thinking, {"part_kind": "text", "content": f"a{n}"}]},
        ]
        turns.append(
            {"_id": f"h-{n}", "conversation_id": "c-h",
             "created_at": MESSY_START + timedelta(hours=n), "user_message": f"q{n}",
             "response_parts": [{"type": "text", "content": f"a{n}"}],
             "message_history_json": json.dumps(said)}
        )  # fmt: skip

    problems = convert(turns).problems

    assert [(p.kind, p.legacy_id, p.content) for p in problems] == [
        ("history_only_content", "h-0", thinking)
    ]


def answers_with_histories(
    answered: list[bool], *, window: int | None = None
) -> list[dict[str, Any]]:
    """Turns each answering "Done.": in its parts where `answered` says so, always in its
    history (the conversation so far, or its last `window` exchanges)."""
    turns, said = [], []
    for n, in_parts in enumerate(answered):
        said += [
            {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": f"q{n}"}]},
            {"kind": "response", "parts": [{"part_kind": "text", "content": "Done."}]},
        ]
        parts = (
            [{"type": "text", "content": "Done."}]
            if in_parts
            else [
                {
                    "type": "tool_call",
                    "tool_name": "cancel",
                    "args": {"n": n},
                    "tool_call_id": f"c{n}",
                },
                {
                    "type": "tool_result",
                    "tool_name": "cancel",
                    "result": "ok",
                    "tool_call_id": f"c{n}",
                },
            ]
        )
        shown = said[-2 * window :] if window else said
        turns.append(
            {"_id": f"h-{n}", "conversation_id": "c-h",
             "created_at": MESSY_START + timedelta(hours=n), "user_message": f"q{n}",
             "response_parts": parts, "message_history_json": json.dumps(shown)}
        )  # fmt: skip
    return turns


@pytest.mark.parametrize(
    ("answered", "kept_on"),
    [([True, False], "h-1"), ([False, True], "h-0"), ([True, False, True], "h-1")],
    ids=["an-earlier-turn-said-it", "a-later-turn-said-it", "turns-around-said-it"],
)
def test_an_answer_only_its_turns_history_holds_is_kept_though_another_turn_said_the_same(
    answered: list[bool], kept_on: str
) -> None:
    """A history says "Done." as often as the turns answered it: an answer no message of its
    turn holds is kept in a problem on that turn, though another turn's message says the
    same words; a message holds a history's text only once, and only for its own turn and
    the later ones."""
    problems = convert(answers_with_histories(answered)).problems

    assert [(p.kind, p.legacy_id, p.placed, p.content) for p in problems] == [
        ("history_only_content", kept_on, True, {"part_kind": "text", "content": "Done."})
    ]


@pytest.mark.parametrize("window", [None, 1, 2], ids=["whole", "last-exchange", "last-two"])
def test_answers_said_alike_by_every_turn_and_its_history_are_no_problem(
    window: int | None,
) -> None:
    """Every turn answered "Done." and its history says so, whole or as a window of its last
    exchanges (the same text at other places each time): each is held by its turn's message."""
    assert convert(answers_with_histories([True] * 4, window=window)).problems == []


def test_hidden_context_only_a_history_holds_is_kept_as_hidden_runtime_context() -> None:
    """The runtime context of a history's user prompt is not what the user saw: the same
    rule as for a user_message (unplaced), unless a problem keeps that context already."""
    said = [{"kind": "request", "parts": [{"part_kind": "user-prompt",
             "content": "[RUNTIME CONTEXT]«tier: gold»[/RUNTIME CONTEXT] hi"}]}]  # fmt: skip
    turn = {"_id": "h-1", "conversation_id": "c-h", "created_at": MESSY_START,
            "user_message": "hi", "message_history_json": json.dumps(said)}  # fmt: skip

    problems = convert([turn]).problems

    assert [(p.kind, p.field, p.placed, p.content) for p in problems] == [
        ("hidden_runtime_context", "message_history_json", False,
         "[RUNTIME CONTEXT]«tier: gold»[/RUNTIME CONTEXT]")
    ]  # fmt: skip


def test_a_history_repeating_the_previous_turns_is_read_for_what_it_adds_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each history repeats the conversation so far: its tool-call ids and its check cost one
    pass over the messages it adds, not over all it repeats (a conversation of n turns costs
    n, not n²)."""
    import agent_store.legacy._convert as converter

    read: list[Any] = []
    normalize = converter.normalize_part
    monkeypatch.setattr(converter, "normalize_part", lambda p: read.append(p) or normalize(p))
    said: list[dict[str, Any]] = []
    turns = []
    for n in range(200):
        said += [
            {"kind": "request", "parts": [{"part_kind": "user-prompt", "content": f"q{n}"}]},
            {"kind": "response", "parts": [{"part_kind": "text", "content": f"a{n}"}]},
        ]
        turns.append(
            {"_id": f"h-{n:03d}", "conversation_id": "c-h",
             "created_at": MESSY_START + timedelta(minutes=n), "user_message": f"q{n}",
             "response_parts": [{"type": "text", "content": f"a{n}"}],
             "message_history_json": json.dumps(said)}
        )  # fmt: skip

    assert convert(turns).problems == []
    assert len(read) <= 4 * len(turns)


def test_a_prompt_naming_another_user_than_the_owner_is_a_mixed_users_problem_not_its_prompt() -> (
    None
):
    """The users a conversation's turns and prompts name, by one rule: a prompt naming
    another user than the owner is never the owner's pending prompt; the conversation is a
    `mixed_user_ids` problem naming each user's turns and prompts, and the pending prompt is
    kept whole in a problem of its own (both not placed)."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    turns = [
        {"_id": "a1", "conversation_id": "c-1", "user_id": "alice", "created_at": at,
         "user_message": "hi", "response_parts": [{"type": "text", "content": "hello"}]}
    ]  # fmt: skip
    prompts = [
        {"_id": "p-1", "conversation_id": "c-1", "user_id": "mallory", "request_id": "r9",
         "action": "wire_money", "prompt": "approve?", "status": "pending"},
        {"_id": "p-2", "conversation_id": "c-1", "user_id": "alice", "request_id": "r1",
         "action": "book", "prompt": "book it?", "status": "pending"},
    ]  # fmt: skip
    conversion = with_session_prompts(convert(turns), prompts)

    assert conversion.conversation is not None
    assert conversion.conversation.pending_hitl is not None
    assert conversion.conversation.pending_hitl.request_id == "r1"
    by_kind = {p.kind: p for p in conversion.unplaced}
    assert set(by_kind) == {"mixed_user_ids", "pending_prompt_not_placed"}
    assert by_kind["mixed_user_ids"].content == {"alice": ["a1"], "mallory": ["session_hitl|r9"]}
    assert by_kind["pending_prompt_not_placed"].content == prompts[0]
    only_alice = with_session_prompts(convert(turns), prompts[1:])
    assert [p.kind for p in only_alice.problems] == ["pending_hitl_without_message"]


def test_a_prompt_naming_a_user_is_never_the_pending_prompt_of_a_conversation_no_user_owns() -> (
    None
):
    """Turns naming no user make a conversation no user owns, which the next service turn
    naming anyone adopts: a prompt naming a user is never its pending prompt (that user owns
    no such conversation); the pending one is kept whole in a problem, and the conversation
    is a `mixed_user_ids` problem naming that user (both not placed). A prompt naming no
    user is its own."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    turns = [
        {"_id": "t1", "conversation_id": "c-n", "created_at": at, "user_message": "pay rent",
         "response_parts": [{"type": "text", "content": "I need approval"}]}
    ]  # fmt: skip
    prompt = {"_id": "p-1", "conversation_id": "c-n", "user_id": "u-a", "request_id": "r1",
              "action": "pay", "params": {"iban": "A-SECRET-IBAN"}, "status": "pending",
              "created_at": at + timedelta(minutes=5)}  # fmt: skip
    conversion = with_session_prompts(convert(turns), [prompt])

    assert conversion.conversation is not None
    assert conversion.conversation.user_id is None
    assert conversion.conversation.pending_hitl is None
    by_kind = {p.kind: p for p in conversion.unplaced}
    assert set(by_kind) == {"mixed_user_ids", "pending_prompt_not_placed"}
    assert by_kind["mixed_user_ids"].content == {"u-a": ["session_hitl|r1"]}
    assert by_kind["pending_prompt_not_placed"].content == prompt
    nobodys = with_session_prompts(convert(turns), [prompt | {"user_id": " "}]).conversation
    assert nobodys is not None
    assert nobodys.pending_hitl is not None


@pytest.mark.parametrize(
    "other", ["alice+work@example.com", "tenant/alice", 4.2e20], ids=["email", "path", "double"]
)
def test_a_prompt_naming_a_user_no_token_can_be_is_not_the_owners_prompt(other: Any) -> None:
    """A user id that is no identifier still names a user (the one the migration stores it
    as, `derived_user_id`): their pending prompt is kept in a problem, never the owner's."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    turns = [
        {"_id": f"t{n}", "conversation_id": "c-1", "user_id": user,
         "created_at": at + timedelta(minutes=n), "user_message": "hi",
         "response_parts": [{"type": "text", "content": "hello"}]}
        for n, user in enumerate([other, "mallory"])
    ]  # fmt: skip
    prompt = {"_id": "p-1", "conversation_id": "c-1", "user_id": other, "request_id": "r9",
              "action": "wire_money", "prompt": "approve?", "status": "pending",
              "created_at": at + timedelta(minutes=2)}  # fmt: skip
    conversion = with_session_prompts(convert(turns), [prompt])

    assert conversion.conversation is not None
    assert conversion.conversation.pending_hitl is None
    by_kind = {p.kind: p for p in conversion.unplaced}
    assert set(by_kind) == {"mixed_user_ids", "pending_prompt_not_placed"}
    assert by_kind["mixed_user_ids"].content == {
        str(other): ["t0", "session_hitl|r9"],
        "mallory": ["t1"],
    }
    assert by_kind["pending_prompt_not_placed"].content == prompt
    owned = with_session_prompts(convert(turns[:1]), [prompt]).conversation
    assert owned is not None
    assert owned.user_id == derived_user_id(str(other))
    assert owned.pending_hitl is not None
    assert owned.pending_hitl.request_id == "r9"


def test_a_conversation_whose_turns_hold_only_a_name_keeps_it_in_an_unplaced_problem() -> None:
    """No message, so no conversation document holds the name: a problem does."""
    turns = [{"_id": "t1", "conversation_id": "c-1", "user_id": "u", "name": "«Tax 2024»"}]
    conversion = convert(turns)

    assert conversion.conversation is None
    [problem] = conversion.unplaced
    assert (problem.kind, problem.field, problem.content) == (
        "name_without_messages",
        "name",
        "«Tax 2024»",
    )


def test_turns_holding_only_names_keep_the_last_that_shows_something() -> None:
    """A later invisible name names nothing: the real name before it is the one kept."""
    turns = [{"_id": "t1", "conversation_id": "c-1", "user_id": "u", "name": "«Tax 2024»",
              "created_at": datetime(2024, 1, 1, tzinfo=UTC)},
             {"_id": "t2", "conversation_id": "c-1", "user_id": "u", "name": "\u200b",
              "created_at": datetime(2024, 1, 2, tzinfo=UTC)}]  # fmt: skip
    [problem] = convert(turns).unplaced

    assert (problem.kind, problem.content) == ("name_without_messages", "«Tax 2024»")


def test_turns_naming_several_users_are_an_unplaced_problem_naming_each_users_turns() -> None:
    """The last user owns every message, the others' words too: content no message keeps as
    theirs, so an operator must accept it."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    turns = [
        {"_id": n, "conversation_id": "c-1", "user_id": user, "created_at": at + timedelta(n),
         "user_message": f"hi from {user}"}
        for n, user in enumerate(["u-c", "u-a", "u-c"])
    ]  # fmt: skip
    conversion = convert(turns)

    assert {m.user_id for m in conversion.messages} == {"u-c"}
    [problem] = conversion.unplaced
    assert problem.kind == "mixed_user_ids"
    assert problem.content == {"u-c": ["0", "2"], "u-a": ["1"]}
    assert "'u-a'" in problem.detail
    assert "'u-c'" in problem.detail


@pytest.mark.parametrize(
    ("first", "later", "typed"),
    [
        (5, "5", '"5"'),
        ("5", Int64(5), '{"$numberLong": "5"}'),
        (ObjectId("65e1a0000000000000000001"), "65e1a0000000000000000001",
         '"65e1a0000000000000000001"'),
    ],
)  # fmt: skip
def test_turns_naming_no_conversation_whose_ids_read_alike_are_told_apart(
    first: Any, later: Any, typed: str
) -> None:
    """The first in time goes by its `_id`'s text, a later one by its extended JSON, hashed:
    two conversations, whichever order the turns are given in."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    turns = [
        {"_id": later, "conversation_id": "", "created_at": at + timedelta(minutes=1)},
        {"_id": first, "conversation_id": None, "created_at": at},
    ]
    unnamed = tell_apart(turns)
    hashed = "legacy-turn-h" + hashlib.sha256(typed.encode()).hexdigest()[:32]

    assert unnamed.ids == {f"legacy-turn-{first}": [first], hashed: [later]}
    grouped = group_conversations(parse_turns(turns, unnamed.names))
    assert sorted(grouped) == sorted(unnamed.ids)


def test_a_turn_whose_id_spells_the_name_a_later_alike_turn_would_get_keeps_it_alone() -> None:
    """A later turn of two whose ids read alike goes by its extended JSON, hashed; a third
    turn naming no conversation whose `_id` is that hash's text keeps the name, and the later
    turn takes the next one: three conversations, never two users' turns in one."""
    at = datetime(2024, 1, 1, tzinfo=UTC)
    collides = "h" + hashlib.sha256(b'"5"').hexdigest()[:32]
    turns = [
        {"_id": 5, "conversation_id": None, "created_at": at},
        {"_id": "5", "conversation_id": None, "created_at": at + timedelta(minutes=1)},
        {"_id": collides, "conversation_id": None, "created_at": at + timedelta(minutes=2)},
    ]

    unnamed = tell_apart(turns)

    assert len(unnamed.ids) == 3
    assert unnamed.ids[f"legacy-turn-{collides}"] == [collides]
    assert sorted(len(ids) for ids in unnamed.ids.values()) == [1, 1, 1]


def dated_turn(turn_id: Any, at: Any, text: str) -> dict[str, Any]:
    answer = [{"type": "text", "content": "ok"}]
    return {"_id": turn_id, "conversation_id": "c-dates", "user_id": "u1", "created_at": at,
            "user_message": text, "response_parts": answer}  # fmt: skip


@pytest.mark.parametrize(
    "placeholder",
    [datetime(1, 1, 1, tzinfo=UTC), datetime(1969, 7, 20, tzinfo=UTC),
     datetime(2099, 1, 1, tzinfo=UTC), "1969-07-20T00:00:00Z", "2099-01-01T00:00:00Z",
     datetime(1970, 1, 1, tzinfo=UTC), "1970-01-01T00:00:00Z"],
    ids=["zero time", "a date of 1969", "a date of 2099", "1969 as text", "2099 as text",
         "Unix time 0", "Unix time 0 as text"],
)  # fmt: skip
def test_a_turn_dated_outside_what_the_store_takes_is_migrated_with_its_neighbours_time(
    placeholder: Any,
) -> None:
    """Go's and .NET's zero time, a date before 1970 or past now and a day is no time the
    store takes, in BSON or as text, as `0` is none: the turn is migrated with the next
    readable turn's time, and a `missing_created_at` problem keeps the value found."""
    later = datetime(2021, 3, 1, 10, 2, tzinfo=UTC)
    turns = [dated_turn("t1", later - timedelta(minutes=2), "first"),
             dated_turn("t2", placeholder, "second"), dated_turn("t3", later, "third")]  # fmt: skip
    conversion = convert(turns)

    users = [(m.content, m.created_at) for m in conversion.messages if m.role == "user"]
    assert users == [("first", later - timedelta(minutes=2)), ("second", later), ("third", later)]
    assert [(p.kind, p.legacy_id, p.placed, p.content) for p in conversion.problems] == [
        ("missing_created_at", "t2", True, placeholder)
    ]


def test_a_turn_whose_object_id_is_dated_past_what_the_store_takes_uses_its_neighbours_time() -> (
    None
):
    at = datetime(2021, 3, 1, 10, tzinfo=UTC)
    future = ObjectId.from_datetime(datetime(2100, 1, 1, tzinfo=UTC))
    conversion = convert([dated_turn("t1", at, "first"), dated_turn(future, None, "second")])

    assert [m.created_at for m in conversion.messages if m.role == "user"] == [at, at]
    assert [p.kind for p in conversion.problems] == ["missing_created_at"]


@pytest.mark.parametrize(
    "placeholder",
    [datetime(1, 1, 1, tzinfo=UTC), datetime(2099, 1, 1, tzinfo=UTC), "0001-01-01T00:00:00Z"],
    ids=["zero time", "a date of 2099", "zero time as text"],
)
def test_a_pending_prompt_dated_outside_what_the_store_takes_gets_its_messages_time(
    placeholder: Any,
) -> None:
    """As a prompt without a time: the time of the message that raised it."""
    at = datetime(2021, 3, 1, 10, tzinfo=UTC)
    raised = {"type": "hitl", "action": "confirm", "request_id": "r1", "prompt": "Confirm?"}
    conversion = convert([{**dated_turn("t1", at, "book it"), "response_parts": [raised]}])
    prompt = {"conversation_id": "c-dates", "user_id": "u1", "request_id": "r1",
              "action": "confirm", "prompt": "Confirm?", "created_at": placeholder}  # fmt: skip
    pending, _ = pending_from_session_hitl([prompt], conversion.messages)

    assert pending is not None
    assert pending.created_at == at


NOT_JSON: dict[str, Any] = {
    "bytes": b"\x00\xffsecret",
    "uuid": bson.Binary.from_uuid(uuid.UUID("12345678-1234-5678-1234-567812345678")),
    "time": datetime(2024, 2, 29, 12, tzinfo=UTC),
    "objectid": ObjectId("65e1f0000000000000000001"),
    "decimal128": Decimal128("1.50"),
}
"""BSON values JSON cannot encode."""


def _text_turn(where: str, value: Any) -> dict[str, Any]:
    """A turn holding `value` where a message's text is made of it."""
    turn: dict[str, Any] = {"_id": "t1", "conversation_id": "c-text", "user_id": "u1",
                            "created_at": MESSY_START, "user_message": "question",
                            "response_parts": [{"type": "text", "content": "answer"}]}  # fmt: skip
    part = {
        "text": {"type": "text", "content": value},
        "prompt": {"type": "hitl", "action": "confirm", "request_id": "r1", "prompt": value},
        "error": {"type": "error", "message": value},
    }
    if where in part:
        turn["response_parts"] = [part[where]]
    elif where == "response_text":
        del turn["response_parts"]
        turn["response_text"] = value
    else:
        turn[where] = value
    return turn


TEXT_FIELDS = {
    "user_message": ("user_message", None),
    "text": ("response_parts", 0),
    "prompt": ("response_parts", 0),
    "error": ("response_parts", 0),
    "response_text": ("response_text", None),
    "name": ("name", None),
}
"""Where a message's (or the conversation's) text is made of a legacy value: the field and
part index a problem about it names."""


@pytest.mark.parametrize("value", list(NOT_JSON.values()), ids=list(NOT_JSON))
@pytest.mark.parametrize("where", list(TEXT_FIELDS))
def test_a_text_made_of_a_value_json_cannot_encode_is_a_placed_problem_keeping_it(
    where: str, value: Any
) -> None:
    """The text stored is the JSON text spelling the value (a time as ISO text, bytes as
    base64): no longer the value. A placed `non_json_value` problem keeps the value as found
    (an error's whole part, which its text is made of), as for a call's arguments and a
    result: a turn holding the text that value is made into is told apart from it."""
    turn = _text_turn(where, value)
    conversion = convert([turn])

    field, part_index = TEXT_FIELDS[where]
    found = [(p.kind, p.field, p.part_index, p.placed, p.content) for p in conversion.problems]
    kept = turn["response_parts"][0] if where == "error" else value
    assert found == [("non_json_value", field, part_index, True, kept)]
    assert bson.encode({"content": conversion.problems[0].content}) == bson.encode(
        {"content": kept}
    )


def _session_prompt(**fields: Any) -> dict[str, Any]:
    """A pending `session_hitl` prompt of `_text_turn`'s conversation, with `fields`."""
    found = {"conversation_id": "c-text", "user_id": "u1", "request_id": "r1",
             "action": "confirm", "prompt": "Confirm?", "created_at": MESSY_START}  # fmt: skip
    return found | fields


@pytest.mark.parametrize("value", list(NOT_JSON.values()), ids=list(NOT_JSON))
@pytest.mark.parametrize("field", ["prompt", "content"])
def test_a_session_prompt_text_made_of_a_value_json_cannot_encode_is_a_placed_problem(
    field: str, value: Any
) -> None:
    """The pending prompt's text made of a value JSON cannot encode is its JSON text, as a
    turn's prompt is, and a placed `non_json_value` problem keeps the value as found."""
    conversion = convert([_text_turn("prompt", "Confirm?")])
    prompt = _session_prompt(prompt=None) | {field: value}

    pending, notes = pending_from_session_hitl([prompt], conversion.messages)

    assert pending is not None
    assert pending.prompt == as_text(value)
    found = [(n.kind, n.field, n.placed, n.content) for n in notes]
    assert found == [("non_json_value", field, True, value)]


@pytest.mark.parametrize("value", list(NOT_JSON.values()), ids=list(NOT_JSON))
def test_session_prompt_params_a_message_cannot_hold_are_kept_in_a_problem_not_pending(
    value: Any,
) -> None:
    """Params holding a value JSON cannot encode are not what a message holds (a turn's
    HITL part holding them is an invalid part): the pending prompt takes its message's
    params, and a problem (not placed) keeps the prompt's as found. Every reader of the
    conversation can then write its pending prompt as JSON."""
    conversion = convert([_text_turn("prompt", "Confirm?")])
    params = {"booking": {"id": value}}

    pending, notes = pending_from_session_hitl(
        [_session_prompt(params=params)], conversion.messages
    )

    assert pending is not None
    assert pending.params == {}
    json.loads(pending.model_dump_json())
    found = [(n.kind, n.field, n.placed, n.content) for n in notes]
    assert found == [("unread_field", "params", False, params)]


@pytest.mark.parametrize("where", list(TEXT_FIELDS))
def test_the_text_such_a_value_is_stored_as_is_no_problem(where: str) -> None:
    """The same text, found as text, is stored as it is: no problem."""
    typed = convert([_text_turn(where, NOT_JSON["time"])])
    text = convert([_text_turn(where, '"2024-02-29T12:00:00+00:00"')])

    assert text.problems == []
    assert [m.content for m in text.messages] == [m.content for m in typed.messages]


@pytest.mark.parametrize("value", [42, 2.5, True, {"title": "Book?"}, ["a", 1]])
@pytest.mark.parametrize("where", list(TEXT_FIELDS))
def test_a_plain_json_value_read_as_its_json_text_is_no_problem(where: str, value: Any) -> None:
    """A number, a yes/no, an object or a list is read as its JSON text, as documented: the
    text says the value, nothing is changed."""
    conversion = convert([_text_turn(where, value)])

    assert [p.kind for p in conversion.problems if p.kind == "non_json_value"] == []


async def test_a_legacy_conversation_holding_dates_outside_pythons_range_is_read(
    backend: Backend,
) -> None:
    """The service reads a legacy conversation whose turns hold dates no `datetime` holds
    (a client decoding with `DATETIME_AUTO` reads them as `DatetimeMS`): such a time is no
    readable time, and a value in arguments or results is written as text."""
    if backend.name != "mongomock":
        pytest.skip(f"{backend.name}: the server refuses a date outside Python's range")
    year_0, garbage = DatetimeMS(-62_198_755_200_000), DatetimeMS(2**62)
    turn = {"_id": "b-1", "conversation_id": "c-dates", "user_id": "alice",
            "created_at": garbage, "timestamp": year_0, "user_message": "when?",
            "response_parts": [
                {"type": "tool_call", "tool_name": "when", "args": {"at": garbage},
                 "tool_call_id": "x"},
                {"type": "tool_result", "tool_name": "when", "result": year_0,
                 "tool_call_id": "x"}]}  # fmt: skip
    await backend.db[LEGACY_TURNS].insert_one(turn)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    transcript = await store.transcript("c-dates")

    assert [m.role for m in transcript] == ["user", "assistant", "tool"]
    assert str(2**62) in transcript[1].model_dump_json()
    assert str(-62_198_755_200_000) in (transcript[2].content or "")


class UndecodableReplies:
    """A fake of the legacy collection on a server holding a turn whose text is not valid
    UTF-8 (MongoDB stores such bytes unchecked; the stand-ins refuse them): every read of it
    fails as PyMongo's strict decoding of such a reply does, with `InvalidBSON`."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name in ("find", "find_one", "aggregate", "find_one_and_delete", "count_documents"):
            raise bson.errors.InvalidBSON(
                "'utf-8' codec can't decode byte 0xc3 in position 7: invalid continuation byte"
            )
        return getattr(self._real, name)


async def test_a_legacy_turn_the_driver_cannot_decode_is_a_storage_failure_not_a_crash(
    backend: Backend,
) -> None:
    """DESIGN.md: errors are translated at the storage boundary. A legacy turn holding text
    that is not valid UTF-8, which the driver refuses to decode (`InvalidBSON`), makes the
    store's reads and delete of its conversation a StorageFailure saying so (the API's error
    body), never an unhandled driver error; the message repeats none of the stored bytes."""
    await backend.db[LEGACY_TURNS].insert_one(
        {"_id": "t-1", "conversation_id": "c-bad", "user_id": "alice",
         "created_at": MESSY_START, "user_message": "question"}
    )  # fmt: skip
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableReplies(legacy._turns)
    store = ConversationStore(backend.db, legacy=legacy)

    for read in (
        store.get_conversation("c-bad", user_id="alice"),
        store.transcript("c-bad", user_id="alice"),
        store.delete("c-bad", user_id="alice"),
    ):
        with pytest.raises(StorageFailure, match="not valid UTF-8") as caught:
            await read
        assert "0xc3" not in str(caught.value)


async def test_the_api_answers_a_legacy_turn_the_driver_cannot_decode_with_its_error_body() -> None:
    """API.md: the owner's read and delete of a conversation whose legacy turn the driver
    cannot decode (text that is not valid UTF-8) are answered with the API's error body,
    `storage_failure`, not an unhandled exception out of the app."""
    from tests.api_harness import auth_headers, mongomock_db, serve

    db = mongomock_db()
    await db[LEGACY_TURNS].insert_one(
        {"_id": "t-1", "conversation_id": "c-bad", "user_id": "alice",
         "created_at": MESSY_START, "user_message": "question"}
    )  # fmt: skip
    async with serve(db, seeded=False) as served:
        served.store.legacy._turns = UndecodableReplies(served.store.legacy._turns)
        headers = auth_headers(user="alice")
        for method, path in [
            ("GET", "/v1/conversations/c-bad"),
            ("GET", "/v1/conversations/c-bad/messages"),
            ("DELETE", "/v1/conversations/c-bad"),
        ]:
            answer = await served.http.request(method, path, headers=headers)
            assert answer.status_code == 500, (method, path)
            assert answer.json()["error"]["code"] == "storage_failure"
            assert "not valid UTF-8" in answer.json()["error"]["message"]


class Replies:
    """A cursor of a fake collection whose replies `read` turns into what the client decodes
    of them (`UndecodableText`, `AsStored`), sorted, skipped and limited as the real one."""

    def __init__(self, cursor: Any, read: Callable[[list[Any]], list[Any]]) -> None:
        self._cursor, self._read = cursor, read

    def sort(self, *args: Any, **kwargs: Any) -> Replies:
        return Replies(self._cursor.sort(*args, **kwargs), self._read)

    def skip(self, count: int) -> Replies:
        return Replies(self._cursor.skip(count), self._read)

    def limit(self, count: int) -> Replies:
        return Replies(self._cursor.limit(count), self._read)

    async def to_list(self, length: int | None = None) -> list[Any]:
        return self._read(await self._cursor.to_list(length))


class UndecodableText:
    """A fake of a legacy collection on a server holding the document `bad` whose `texts`
    (a turn's `user_message`; a prompt's `prompt`, `action`, `params`, `request_id`) are not
    valid UTF-8: a reply carrying one of those fields fails as PyMongo's strict decoding of
    it does (`InvalidBSON`); one leaving them out (a projection of other fields) decodes."""

    def __init__(self, real: Any, bad: str, texts: tuple[str, ...] = ("user_message",)) -> None:
        self._real, self._bad, self._texts = real, bad, texts

    def _decoded(self, documents: list[Any]) -> list[Any]:
        holding = [d for d in documents if d and d.get("_id") == self._bad]
        if any(field in d for d in holding for field in self._texts):
            raise bson.errors.InvalidBSON(
                "'utf-8' codec can't decode byte 0xc3 in position 7: invalid continuation byte"
            )
        return documents

    def find(self, *args: Any, **kwargs: Any) -> Any:
        return Replies(self._real.find(*args, **kwargs), self._decoded)

    async def find_one(self, *args: Any, **kwargs: Any) -> Any:
        return self._decoded([await self._real.find_one(*args, **kwargs)])[0]

    codec_options = bson.codec_options.CodecOptions(tz_aware=True)
    """PyMongo's (mongomock's own refuses any handler but the strict one)."""

    def with_options(self, *, codec_options: Any) -> Any:
        """The collection read `surrogateescape` (`read_as_stored`): `bad`'s `texts` read
        with each such byte a lone surrogate, as PyMongo decodes them so."""
        assert codec_options.unicode_decode_error_handler == "surrogateescape"
        return AsStored(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class AsStored:
    """`UndecodableText` read `surrogateescape`: the texts of `bad` read with their bytes
    that are not valid UTF-8 (`b"\\xc3\\x28"`) as `\\udcc3(`, nothing refused."""

    def __init__(self, undecodable: UndecodableText) -> None:
        self._of = undecodable

    def _as_stored(self, document: Any) -> Any:
        if not document or document.get("_id") != self._of._bad:
            return document
        texts = [field for field in self._of._texts if isinstance(document.get(field), str)]
        return {**document, **{field: document[field] + "\udcc3(" for field in texts}}

    def find(self, *args: Any, **kwargs: Any) -> Any:
        as_stored = self._as_stored
        return Replies(
            self._of._real.find(*args, **kwargs), lambda found: [as_stored(d) for d in found]
        )

    async def find_one(self, *args: Any, **kwargs: Any) -> Any:
        return self._as_stored(await self._of._real.find_one(*args, **kwargs))


async def _undecodable_legacy_of_alice(db: Any) -> None:
    """Alice's legacy-only conversations: `c-bad`, holding a turn whose text the driver
    cannot decode (`UndecodableText`), and `c-clean`."""
    await db[LEGACY_TURNS].insert_many(
        [
            {"_id": f"t-{name}", "conversation_id": f"c-{name}", "user_id": "alice",
             "created_at": MESSY_START, "user_message": f"alice's {name} question"}
            for name in ("bad", "clean")
        ]
    )  # fmt: skip


async def test_another_users_legacy_turn_the_driver_cannot_decode_is_not_found_to_a_user(
    backend: Backend,
) -> None:
    """API.md: to a user another user's conversation is missing, whatever it holds. Mallory's
    reads and writes of Alice's legacy conversation holding a turn the driver cannot decode
    are NotFound, as for Alice's clean one or a missing id (never the StorageFailure that
    tells the id holds another user's undecodable text), nothing deleted; Alice, its owner,
    still gets the StorageFailure."""
    await _undecodable_legacy_of_alice(backend.db)
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad")
    store = ConversationStore(backend.db, legacy=legacy)

    for cid in ("c-bad", "c-clean", "c-missing"):
        for call in (
            partial(store.get_conversation, cid),
            partial(store.transcript, cid),
            partial(store.pending_hitl, cid),
            partial(store.rename, cid, "mine"),
            partial(store.resolve_hitl, cid, "confirm-1"),
            partial(store.delete, cid),
        ):
            with pytest.raises(NotFound):
                await call(user_id="mallory")

    assert await backend.db[LEGACY_TURNS].count_documents({}) == 2
    with pytest.raises(StorageFailure, match="not valid UTF-8"):
        await store.get_conversation("c-bad", user_id="alice")
    assert (await store.get_conversation("c-clean", user_id="alice")).user_id == "alice"


async def test_the_api_answers_another_users_undecodable_legacy_conversation_with_a_404() -> None:
    """API.md: a user token's requests on another user's legacy conversation holding a turn
    the driver cannot decode are 404 `not_found`, as on a missing id (was: 500
    `storage_failure`), and the owner's read is still the 500 naming the fault."""
    from tests.api_harness import auth_headers, mongomock_db, serve

    db = mongomock_db()
    await _undecodable_legacy_of_alice(db)
    async with serve(db, seeded=False) as served:
        served.store.legacy._turns = UndecodableText(served.store.legacy._turns, "t-bad")
        mallory = auth_headers(user="mallory")
        for method, path, body in [
            ("GET", "/v1/conversations/c-bad", None),
            ("GET", "/v1/conversations/c-bad/transcript", None),
            ("GET", "/v1/conversations/c-bad/messages", None),
            ("GET", "/v1/conversations/c-bad/hitl", None),
            ("PATCH", "/v1/conversations/c-bad", {"name": "mine"}),
            ("POST", "/v1/conversations/c-bad/hitl/resolve", {"request_id": "confirm-1"}),
            ("DELETE", "/v1/conversations/c-bad", None),
        ]:
            answer = await served.http.request(method, path, json=body, headers=mallory)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "not_found"
        owners = await served.http.get(
            "/v1/conversations/c-bad", headers=auth_headers(user="alice")
        )
        assert owners.status_code == 500
        assert owners.json()["error"]["code"] == "storage_failure"


PROMPT_TEXTS = ("prompt", "action", "params", "request_id")
"""The texts of a `session_hitl` prompt `UndecodableText` finds not valid UTF-8."""


async def _legacy_with_undecodable_prompt(db: Any, *, owner: str, prompter: str | None) -> None:
    """`owner`'s legacy-only conversation `c-x` (one turn) and, under its id, a pending
    `session_hitl` prompt `p-bad` naming `prompter` (None: no user) whose texts the driver
    cannot decode (`UndecodableText` over `PROMPT_TEXTS`)."""
    await db[LEGACY_TURNS].insert_one(
        {"_id": "t-1", "conversation_id": "c-x", "user_id": owner,
         "created_at": MESSY_START, "user_message": f"{owner}'s question"}
    )  # fmt: skip
    await db[SESSION_HITL].insert_one(
        {"_id": "p-bad", "conversation_id": "c-x", "user_id": prompter,
         "request_id": "confirm-x", "action": "confirm", "prompt": "Pay 9 EUR?",
         "status": "pending", "created_at": MESSY_START + timedelta(minutes=1)}
    )  # fmt: skip


def _with_undecodable_prompt(db: Any) -> ConversationStore:
    """A store whose legacy prompts hold `p-bad`'s texts undecodable (`UndecodableText`)."""
    legacy = LegacyTurns(db)
    legacy._prompts = UndecodableText(legacy._prompts, "p-bad", PROMPT_TEXTS)
    return ConversationStore(db, legacy=legacy)


@pytest.mark.parametrize(("owner", "prompter"), [("alice", "mallory"), ("mallory", "alice")])
async def test_another_users_undecodable_prompt_under_the_id_is_no_obstacle_to_a_read(
    backend: Backend, owner: str, prompter: str
) -> None:
    """API.md, MIGRATION.md: a `session_hitl` prompt naming another user is no part of a
    user's conversation, so what its texts hold is never decoded for her: the owner's reads
    of her legacy conversation under whose id another user's prompt holds text the driver
    cannot decode are served as without it (was: StorageFailure, telling her that the id
    holds another user's undecodable text), and so is a service's read (the conversation
    does not take it either); the prompter's are NotFound, as for any other user."""
    await _legacy_with_undecodable_prompt(backend.db, owner=owner, prompter=prompter)
    store = _with_undecodable_prompt(backend.db)

    for reader in (owner, None):
        conversation = await store.get_conversation("c-x", user_id=reader)
        assert (conversation.user_id, conversation.pending_hitl) == (owner, None)
        transcript = await store.transcript("c-x", user_id=reader)
        assert [m.content for m in transcript][:1] == [f"{owner}'s question"]
        assert await store.pending_hitl("c-x", user_id=reader) is None
    with pytest.raises(NotFound):
        await store.get_conversation("c-x", user_id=prompter)


@pytest.mark.parametrize("prompter", ["alice", None])
async def test_a_users_own_undecodable_prompt_is_a_storage_failure_to_her_alone(
    backend: Backend, prompter: str | None
) -> None:
    """API.md: a prompt that is the owner's part of her legacy conversation (naming her, or
    no user) holding text the driver cannot decode is the StorageFailure naming the fault to
    her and to a service; to another user the conversation is NotFound, as a clean one."""
    await _legacy_with_undecodable_prompt(backend.db, owner="alice", prompter=prompter)
    store = _with_undecodable_prompt(backend.db)

    for reader in ("alice", None):
        with pytest.raises(StorageFailure, match="not valid UTF-8"):
            await store.get_conversation("c-x", user_id=reader)
    with pytest.raises(NotFound):
        await store.get_conversation("c-x", user_id="mallory")


async def test_another_users_undecodable_turn_is_left_out_of_the_owners_reads(
    backend: Backend,
) -> None:
    """API.md: a legacy conversation whose turns name Alice, then Mallory (hers: the last
    user named) holds Alice's turn the driver cannot decode. That turn is no part of
    Mallory's conversation, so its text is never decoded for her: her reads are served
    without it (was: StorageFailure, telling her that the id holds another user's
    undecodable text); Alice's are NotFound (not hers); a service, which reads every turn,
    gets the StorageFailure."""
    await backend.db[LEGACY_TURNS].insert_many(
        [
            {"_id": "t-bad", "conversation_id": "c-x", "user_id": "alice",
             "created_at": MESSY_START, "user_message": "alice's question"},
            {"_id": "t-mal", "conversation_id": "c-x", "user_id": "mallory",
             "created_at": MESSY_START + timedelta(minutes=1),
             "user_message": "mallory's question"},
        ]
    )  # fmt: skip
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad")
    store = ConversationStore(backend.db, legacy=legacy)

    assert (await store.get_conversation("c-x", user_id="mallory")).user_id == "mallory"
    transcript = await store.transcript("c-x", user_id="mallory")
    assert [m.content for m in transcript] == ["mallory's question"]
    assert await store.pending_hitl("c-x", user_id="mallory") is None
    with pytest.raises(NotFound):
        await store.get_conversation("c-x", user_id="alice")
    with pytest.raises(StorageFailure, match="not valid UTF-8"):
        await store.get_conversation("c-x")


async def test_the_api_serves_a_legacy_conversation_beside_another_users_undecodable_text() -> None:
    """API.md: the owner's requests on her legacy conversation are answered as on a clean one
    when only another user's prompt under its id (or another user's turn in it) holds text
    the driver cannot decode: GET, transcript, messages and hitl 200, PATCH and hitl/resolve
    409 "not migrated yet", DELETE 200 (was: 500 `storage_failure` each); her own
    undecodable prompt is still the 500."""
    from tests.api_harness import auth_headers, mongomock_db, serve

    reads = [("GET", route, None) for route in ("", "/transcript", "/messages", "/hitl")]
    writes = [
        ("PATCH", "", {"name": "mine"}),
        ("POST", "/hitl/resolve", {"request_id": "confirm-x"}),
        ("DELETE", "", None),
    ]
    answered = [200] * len(reads) + [409, 409, 200]

    async def answers(db: Any, bad: str, user: str, requests: list[Any]) -> list[Any]:
        async with serve(db, seeded=False) as served:
            legacy = served.store.legacy
            if bad == "p-bad":
                legacy._prompts = UndecodableText(legacy._prompts, bad, PROMPT_TEXTS)
            else:
                legacy._turns = UndecodableText(legacy._turns, bad)
            found = []
            for method, route, body in requests:
                path = f"/v1/conversations/c-x{route}"
                answer = await served.http.request(
                    method, path, json=body, headers=auth_headers(user=user)
                )
                assert user == "alice" or "alice's question" not in answer.text
                found.append(answer.status_code)
            return found

    db = mongomock_db()
    await _legacy_with_undecodable_prompt(db, owner="alice", prompter="mallory")
    assert await answers(db, "p-bad", "alice", reads + writes) == answered
    db = mongomock_db()
    await _legacy_with_undecodable_prompt(db, owner="alice", prompter="alice")
    assert await answers(db, "p-bad", "alice", reads) == [500] * len(reads)
    db = mongomock_db()
    await db[LEGACY_TURNS].insert_many(
        [
            {"_id": "t-bad", "conversation_id": "c-x", "user_id": "alice",
             "created_at": MESSY_START, "user_message": "alice's question"},
            {"_id": "t-mal", "conversation_id": "c-x", "user_id": "mallory",
             "created_at": MESSY_START + timedelta(minutes=1), "user_message": "hers"},
        ]
    )  # fmt: skip
    assert await answers(db, "t-bad", "mallory", reads + writes) == answered


OWNERSHIP_FIELDS_READ = ("user_id", "conversation_id")
"""The fields a legacy turn's or prompt's ownership is read from that `UndecodableText` makes
hold bytes that are not valid UTF-8."""


async def _alice_then_undecodable_turn(db: Any) -> None:
    """Alice's legacy conversation `c-x`: her turn `t-1`, then `t-bad` naming Mallory (the
    owner by the last-named rule, were it readable)."""
    await db[LEGACY_TURNS].insert_many(
        [
            {"_id": "t-1", "conversation_id": "c-x", "user_id": "alice",
             "created_at": MESSY_START, "user_message": "alice's question"},
            {"_id": "t-bad", "conversation_id": "c-x", "user_id": "mallory",
             "created_at": MESSY_START + timedelta(minutes=1),
             "user_message": "mallory's question"},
        ]
    )  # fmt: skip


@pytest.mark.parametrize("field", OWNERSHIP_FIELDS_READ)
async def test_a_legacy_turn_whose_owner_cannot_be_read_belongs_to_nobody(
    backend: Backend, field: str
) -> None:
    """API.md, SECURITY.md: a legacy turn whose `user_id` or `conversation_id` holds bytes
    the driver cannot decode names no owner anyone can be: the owner of the other turns of
    the conversation is served them without it, another user gets NotFound as for a missing
    id, a service a Conflict naming the turn and the field (was: StorageFailure to each, the
    ownership read refusing the whole reply); her delete leaves it where it is."""
    await _alice_then_undecodable_turn(backend.db)
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad", (field,))
    store = ConversationStore(backend.db, legacy=legacy)

    assert (await store.get_conversation("c-x", user_id="alice")).user_id == "alice"
    transcript = await store.transcript("c-x", user_id="alice")
    assert [m.content for m in transcript] == ["alice's question"]
    for reader in ("mallory", "eve"):
        with pytest.raises(NotFound) as refused:
            await store.get_conversation("c-x", user_id=reader)
        assert "UTF-8" not in str(refused.value)
    with pytest.raises(Conflict, match=f"legacy turn 't-bad'.*{field}.*not valid UTF-8"):
        await store.get_conversation("c-x")
    with pytest.raises(Conflict, match="not migrated yet"):
        await store.rename("c-x", "mine", user_id="alice")
    with pytest.raises(NotFound):
        await store.rename("c-x", "mine", user_id="mallory")
    assert await store.delete("c-x", user_id="alice")
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["t-bad"]


@pytest.mark.parametrize("field", OWNERSHIP_FIELDS_READ)
async def test_an_id_held_only_by_a_legacy_turn_whose_owner_cannot_be_read_stays_held(
    backend: Backend, field: str
) -> None:
    """API.md: a write or a fork into an id that exists as legacy turns not migrated yet is
    409 (to a user token the turns do not name, 404), nothing written; a turn whose owner
    cannot be read names nobody, so it is 404 to every user token and 409 to a service, and
    the id stays the legacy conversation's once Alice deleted her part of it (was: the turn
    set apart as nobody's left the id free: any user's turn or fork created a conversation
    over the unmigrated turn, and the service's 409 became that user's conversation)."""
    await _alice_then_undecodable_turn(backend.db)
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad", (field,))
    logger = AgentMessageLogger(backend.db, legacy=legacy)
    store = ConversationStore(backend.db, legacy=legacy)
    await logger.log_messages("c-src", [{"role": "user", "content": "hi"}], turn_id="s-1")
    assert await store.delete("c-x", user_id="alice")

    for user in ("alice", "mallory"):
        with pytest.raises(NotFound):
            await logger.log_messages(
                "c-x", [{"role": "user", "content": "mine now"}], user_id=user, strict_owner=True
            )
    with pytest.raises(Conflict, match="not migrated yet"):
        await logger.log_messages("c-x", [{"role": "user", "content": "mine now"}])
    with pytest.raises(Conflict, match="exists"):
        await logger.fork("c-src", 0, "c-x")
    assert await backend.db[CONVERSATIONS].count_documents({"_id": "c-x"}) == 0
    assert await backend.db[MESSAGES].count_documents({"conversation_id": "c-x"}) == 0
    assert [t["_id"] for t in await backend.db[LEGACY_TURNS].find().to_list(None)] == ["t-bad"]


@pytest.mark.parametrize("field", OWNERSHIP_FIELDS_READ)
async def test_a_prompt_whose_owner_cannot_be_read_is_no_part_of_any_conversation(
    backend: Backend, field: str
) -> None:
    """API.md: a `session_hitl` prompt whose `user_id` or `conversation_id` holds bytes the
    driver cannot decode is taken by no conversation (its owner cannot be told; the prompt
    here names Alice, read as stored): the owner's and a service's reads are served without
    it, another user's are NotFound, her delete leaves it where it is (was: StorageFailure
    to each, the prompt's ownership read refusing the whole reply)."""
    await _legacy_with_undecodable_prompt(backend.db, owner="alice", prompter="alice")
    legacy = LegacyTurns(backend.db)
    legacy._prompts = UndecodableText(legacy._prompts, "p-bad", (field,))
    store = ConversationStore(backend.db, legacy=legacy)

    for reader in ("alice", None):
        conversation = await store.get_conversation("c-x", user_id=reader)
        assert (conversation.user_id, conversation.pending_hitl) == ("alice", None)
        assert await store.pending_hitl("c-x", user_id=reader) is None
    with pytest.raises(NotFound):
        await store.get_conversation("c-x", user_id="mallory")
    assert await store.delete("c-x", user_id="alice")
    assert [p["_id"] for p in await backend.db[SESSION_HITL].find().to_list(None)] == ["p-bad"]


async def test_the_api_answers_a_legacy_turn_whose_owner_cannot_be_read_without_a_500() -> None:
    """API.md: a legacy turn whose `user_id` holds bytes the driver cannot decode: the owner
    of the conversation's other turns reads them (200, without it), another user gets the
    404 a missing id gets, byte for byte, a service the 409 `conflict` naming the turn and
    the field (was: 500 `storage_failure` to each)."""
    from tests.api_harness import auth_headers, mongomock_db, serve

    db = mongomock_db()
    await _alice_then_undecodable_turn(db)
    async with serve(db, seeded=False) as served:
        served.store.legacy._turns = UndecodableText(
            served.store.legacy._turns, "t-bad", ("user_id",)
        )
        alice = await served.http.get(
            "/v1/conversations/c-x/transcript", headers=auth_headers(user="alice")
        )
        assert alice.status_code == 200, alice.text
        assert "mallory's question" not in alice.text
        mallory = auth_headers(user="mallory")
        theirs = await served.http.get("/v1/conversations/c-x", headers=mallory)
        missing = await served.http.get("/v1/conversations/c-missing", headers=mallory)
        assert theirs.status_code == 404
        assert theirs.text.replace("c-x", "c-missing") == missing.text
        service = await served.http.get("/v1/conversations/c-x", headers=auth_headers())
        assert service.status_code == 409, service.text
        assert "'t-bad'" in service.json()["error"]["message"]
        assert "user_id" in service.json()["error"]["message"]


def _stuck_turn(turn_id: str, user_id: str, conversation_id: str) -> dict[str, Any]:
    """A legacy turn a copy left in `agent_conversations` (text that is not valid UTF-8,
    MIGRATION.md), standing under `turn_id`, of `user_id`'s conversation `conversation_id`:
    no conversation document (no counter), held back until an operator corrects it."""
    return {"_id": turn_id, "conversation_id": conversation_id, "user_id": user_id,
            "created_at": MESSY_START, "user_message": "stuck words",
            "response_parts": [{"type": "text", "content": "stuck answer"}]}  # fmt: skip


async def _stuck_beside_legacy(db: Any, *, legacy_under_its_id: bool) -> dict[str, Any]:
    """Alice's turn of `c-bad` left in `agent_conversations` under the `_id` `c-held`, beside
    the legacy collection the copy filled (Bob's `c-other`; with `legacy_under_its_id`, Bob's
    legacy conversation `c-held` too, which the turn holds back, `held_by_left`). The turn."""
    stuck = _stuck_turn("c-held", "alice", "c-bad")
    await db[CONVERSATIONS].insert_one(stuck)
    named = ["c-other"] + (["c-held"] if legacy_under_its_id else [])
    await db[LEGACY_TURNS].insert_many(
        [{"_id": f"t-{cid}", "conversation_id": cid, "user_id": "bob",
          "created_at": MESSY_START, "user_message": f"bob's {cid} question"}
         for cid in named]
    )  # fmt: skip
    return stuck


async def test_a_turn_left_in_agent_conversations_is_no_conversation_of_the_id_it_stands_under(
    backend: Backend,
) -> None:
    """MIGRATION.md: a turn a copy left in `agent_conversations` is no conversation document,
    so the conversation whose id its `_id` is, with no legacy turn of its own, does not
    exist: every read of it is NotFound (404) to its turn's user, another user and a service
    alike, never an empty conversation (was: `transcript` and `messages_page` `[]`,
    `get_conversation` and `rename` a ValidationError, 500), and no write reaches the turn
    (was: `rename` wrote a name into it, `delete` deleted it, its words in no collection); a
    pop pops nothing, as of a missing id."""
    stuck = await _stuck_beside_legacy(backend.db, legacy_under_its_id=False)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    for user_id in ("alice", "bob", None):
        for call in (
            partial(store.get_conversation, "c-held"),
            partial(store.transcript, "c-held"),
            partial(store.messages_page, "c-held"),
            partial(store.turn_count, "c-held"),
            partial(store.rename, "c-held", "mine"),
            partial(store.delete, "c-held"),
        ):
            with pytest.raises(NotFound):
                await call(user_id=user_id)
        assert await store.pop_last_message("c-held", user_id=user_id) is None  # as for none

    assert await backend.db[CONVERSATIONS].find_one({"_id": "c-held"}) == stuck


async def test_a_conversation_a_turn_left_in_agent_conversations_holds_back_is_served_from_legacy(
    backend: Backend,
) -> None:
    """MIGRATION.md: the conversation whose id is the `_id` of a turn a copy left in
    `agent_conversations` (Bob's `c-held`, held back) is served from the legacy collection
    only, to its owner and a service, and is NotFound to the turn's user (Alice, who owns no
    conversation under the id); its writes are refused as not migrated yet, and Bob's delete
    takes his legacy turn, never Alice's stuck one (was: the turn read as its document,
    `[]` to Alice and a service, a ValidationError for `get_conversation`)."""
    stuck = await _stuck_beside_legacy(backend.db, legacy_under_its_id=True)
    store = ConversationStore(backend.db, legacy=LegacyTurns(backend.db))

    for user_id in ("bob", None):
        served = await store.transcript("c-held", user_id=user_id)
        assert [m.content for m in served] == ["bob's c-held question"]
        assert (await store.get_conversation("c-held", user_id=user_id)).user_id == "bob"
        page = await store.messages_page("c-held", user_id=user_id)
        assert [m.content for m in page.data] == ["bob's c-held question"]
    for call in (
        partial(store.get_conversation, "c-held"),
        partial(store.transcript, "c-held"),
        partial(store.messages_page, "c-held"),
    ):
        with pytest.raises(NotFound):
            await call(user_id="alice")
    with pytest.raises(Conflict, match="not migrated yet"):
        await store.rename("c-held", "mine", user_id="bob")

    deleted = await store.delete("c-held", user_id="bob")

    assert deleted.legacy_turns == 1
    assert await backend.db[CONVERSATIONS].find_one({"_id": "c-held"}) == stuck
    assert await backend.db[LEGACY_TURNS].count_documents({"conversation_id": "c-held"}) == 0


async def test_the_api_answers_an_id_only_a_stuck_turn_stands_under_with_a_404() -> None:
    """API.md: the requests of the user whose turn a copy left in `agent_conversations`, on
    the id the turn stands under (no conversation), are 404 `not_found` (was: 200 with no
    messages, 500 for the conversation itself)."""
    from tests.api_harness import auth_headers, mongomock_db, serve

    db = mongomock_db()
    await _stuck_beside_legacy(db, legacy_under_its_id=False)
    async with serve(db, seeded=False) as served:
        alice = auth_headers(user="alice")
        for method, path, body in [
            ("GET", "/v1/conversations/c-held", None),
            ("GET", "/v1/conversations/c-held/transcript", None),
            ("GET", "/v1/conversations/c-held/messages", None),
            ("PATCH", "/v1/conversations/c-held", {"name": "mine"}),
            ("DELETE", "/v1/conversations/c-held", None),
        ]:
            answer = await served.http.request(method, path, json=body, headers=alice)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "not_found"


VIEWED_FIELDS = ("user_message", "user_id", "_id")
"""Fields of a legacy turn an operator's comparison reads that `UndecodableText` makes hold
bytes that are not valid UTF-8: a text, the owner, the `_id`."""


@pytest.mark.parametrize("field", VIEWED_FIELDS)
async def test_the_raw_legacy_turns_an_operator_compares_are_read_as_stored(
    backend: Backend, field: str
) -> None:
    """SECURITY.md: the raw legacy turns the viewer's comparison reads (`turns`,
    `turns_page`), and whether a conversation has any (`with_turns`, its lists and
    transcript), read a turn whose text, `user_id` or `_id` holds bytes the driver cannot
    decode as stored, each such byte a lone surrogate, the other turns as they are (was:
    StorageFailure, the strict client refusing the whole reply, for the page)."""
    await _alice_then_undecodable_turn(backend.db)
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad", (field,))

    page, more = await legacy.turns_page("c-x", limit=10)
    for turns in (await legacy.turns("c-x", limit=10), page):
        assert [t["_id"] for t in turns][:1] == ["t-1"]
        assert turns[1][field].endswith("\udcc3(")
        assert turns[0]["user_message"] == "alice's question"
    assert not more
    assert await legacy.with_turns(["c-x", "c-missing"]) == {"c-x"}
    await backend.db[LEGACY_TURNS].delete_one({"_id": "t-1"})
    assert await legacy.with_turns(["c-x"]) == {"c-x"}  # the undecodable turn found first


@pytest.mark.parametrize("field", ["_id", "created_at"])
async def test_a_turn_naming_no_conversation_that_cannot_be_read_stops_no_legacy_turn_id(
    backend: Backend, field: str
) -> None:
    """SECURITY.md: the scan telling apart the turns naming no conversation (`_unnamed`,
    which every `legacy-turn-` id reads) reads their `_id`s and times as stored, so one
    holding bytes the driver cannot decode stops no read of another (was: StorageFailure
    for every `legacy-turn-` id, whoever asked). Named as the migration names it, it is
    nobody's: one whose `_id` cannot be sent in a query is found under no id; one whose time
    cannot be read is a Conflict naming it to a service, NotFound to every user."""
    await backend.db[LEGACY_TURNS].insert_many(
        [
            {"_id": "t-bad", "user_id": "alice", "created_at": "2024-01-01T00:00:00",
             "user_message": "alice's stuck question"},
            {"_id": "t-ok", "user_id": "alice", "created_at": MESSY_START,
             "user_message": "alice's question"},
        ]
    )  # fmt: skip
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad", (field,))
    store = ConversationStore(backend.db, legacy=legacy)

    for reader in ("alice", None):
        transcript = await store.transcript("legacy-turn-t-ok", user_id=reader)
        assert [m.content for m in transcript] == ["alice's question"]
    assert await legacy.with_turns(["legacy-turn-t-ok"]) == {"legacy-turn-t-ok"}
    for reader in ("alice", "mallory"):
        with pytest.raises(NotFound):
            await store.get_conversation("legacy-turn-t-bad", user_id=reader)
    if field == "_id":
        with pytest.raises(NotFound):
            await store.get_conversation("legacy-turn-t-bad")
    else:
        with pytest.raises(Conflict, match=f"legacy turn 't-bad'.*{field}.*not valid UTF-8"):
            await store.get_conversation("legacy-turn-t-bad")
    assert await backend.db[LEGACY_TURNS].count_documents({}) == 2


async def test_a_turn_left_in_agent_conversations_whose_owner_cannot_be_read_holds_its_id(
    backend: Backend,
) -> None:
    """MIGRATION.md, SECURITY.md: a turn a copy left in `agent_conversations` whose `user_id`
    holds bytes the driver cannot decode names nobody, and still holds the id it stands
    under: a write creating a conversation there is refused as for any turn standing under
    it (`_refuse_held_by_a_legacy_turn`), NotFound to every user token (Alice's, whom it
    names as stored, too), Conflict "not migrated yet" to a service, nothing written (was:
    StorageFailure, the strict read of its `user_id` refusing the reply)."""
    stuck = _stuck_turn("c-held", "alice", "c-bad")
    await backend.db[CONVERSATIONS].insert_one(stuck)
    logger = AgentMessageLogger(backend.db)
    logger._conversations = UndecodableText(logger._conversations, "c-held", ("user_id",))
    hi = [{"role": "user", "content": "mine now"}]

    for user in ("alice", "mallory"):
        with pytest.raises(NotFound):
            await logger.log_messages("c-held", hi, user_id=user, strict_owner=True)
        with pytest.raises(NotFound):
            await logger.upsert_conversation("c-held", user_id=user, strict_owner=True)
    with pytest.raises(Conflict, match="not migrated yet"):
        await logger.log_messages("c-held", hi)
    with pytest.raises(Conflict, match="not migrated yet"):
        await logger.upsert_conversation("c-held", create_only=True)
    assert await backend.db[CONVERSATIONS].find_one({"_id": "c-held"}) == stuck
    assert await backend.db[MESSAGES].count_documents({"conversation_id": "c-held"}) == 0


async def test_an_answers_dual_write_marks_the_owners_prompt_beside_one_whose_owner_cannot_be_read(
    backend: Backend,
) -> None:
    """SECURITY.md: the dual write of an answer (`prompt_resolved`) tells the owner's
    `session_hitl` prompts of the request id by their owner read as stored: it marks Alice's
    prompt resolved and leaves one whose `user_id` holds bytes the driver cannot decode as it
    stands, nobody's (was: StorageFailure, the strict read of the prompts refusing the whole
    reply, after the answer was stored)."""
    await AgentMessageLogger(backend.db).log_messages(
        "c-x", [{"role": "user", "content": "pay?"}], user_id="alice"
    )
    await backend.db[SESSION_HITL].insert_many(
        [
            {"_id": f"p-{name}", "conversation_id": "c-x", "user_id": "alice",
             "request_id": "confirm-x", "action": "confirm", "status": "pending",
             "created_at": MESSY_START}
            for name in ("ok", "bad")
        ]
    )  # fmt: skip
    legacy = LegacyTurns(backend.db, dual_write=True)
    legacy._prompts = UndecodableText(legacy._prompts, "p-bad", ("user_id",))

    await legacy.prompt_resolved("c-x", "confirm-x")

    prompts = await backend.db[SESSION_HITL].find({}, {"status": 1}).to_list(None)
    assert {p["_id"]: p["status"] for p in prompts} == {"p-ok": "resolved", "p-bad": "pending"}


@pytest.mark.parametrize("field", OWNERSHIP_FIELDS_READ)
async def test_a_claim_or_an_erasure_leaves_a_turn_and_prompt_whose_owner_cannot_be_read(
    backend: Backend, field: str
) -> None:
    """SECURITY.md: a legacy turn or `session_hitl` prompt whose `user_id` or conversation id
    holds bytes the driver cannot decode is nobody's, to a claim and an erasure as to a
    delete: a claim of the user it seems to name moves the user's other turns and leaves it
    naming her; her erasure takes her other turns and leaves it (was: a claim moved it to
    the new owner, its `conversation_id` not read to tell it apart)."""
    await backend.db[LEGACY_TURNS].insert_many(
        [
            {"_id": "t-m", "conversation_id": "c-m", "user_id": "mallory",
             "created_at": MESSY_START, "user_message": "hers"},
            {"_id": "t-bad", "conversation_id": "c-x", "user_id": "mallory",
             "created_at": MESSY_START, "user_message": "nobody's"},
        ]
    )  # fmt: skip
    await _legacy_with_undecodable_prompt(backend.db, owner="mallory", prompter="mallory")
    legacy = LegacyTurns(backend.db)
    legacy._turns = UndecodableText(legacy._turns, "t-bad", (field,))
    legacy._prompts = UndecodableText(legacy._prompts, "p-bad", (field,))
    store = ConversationStore(backend.db, legacy=legacy)

    claimed = await store.claim("mallory", "bob")
    owners = {t["_id"]: t["user_id"] async for t in backend.db[LEGACY_TURNS].find()}
    assert (owners["t-m"], owners["t-bad"]) == ("bob", "mallory")
    prompt = await backend.db[SESSION_HITL].find_one({"_id": "p-bad"})
    assert (prompt or {}).get("user_id") == "mallory"
    assert claimed.legacy_turns == sum(1 for owner in owners.values() if owner == "bob")
    await store.erase_user("mallory")
    assert await backend.db[LEGACY_TURNS].count_documents({"_id": "t-bad"}) == 1
    assert await backend.db[SESSION_HITL].count_documents({"_id": "p-bad"}) == 1
