"""One reader of the legacy format: every spelling of a part means the same to the converter,
the migration's verify and the viewer; one identifier rule for users everywhere; one rule per
field for what a legacy value may look like: read by that rule, else kept in a problem."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import Decimal128, Int64
from pymongo.database import Database

from agent_store.legacy import SESSION_HITL, convert
from agent_store.store import CONVERSATIONS, MESSAGES
from app.presentation import legacy_turn_view
from migrations.cli import main
from migrations.problems import PROBLEMS

CID = "conv-spellings"
AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def spelled_turns(user_id: str = "user-spell") -> list[dict[str, Any]]:
    """A turn whose parts use the spellings other writers used for text, calls and results."""
    return [
        {
            "_id": "spell-1",
            "conversation_id": CID,
            "user_id": user_id,
            "created_at": AT,
            "user_message": "What is the weather?",
            "response_parts": [
                {"type": "text_part", "content": "Let me look."},
                {"part_kind": "tool-call", "tool_name": "weather", "args": {"city": "Oslo"},
                 "tool_call_id": "call-1"},
                {"part_kind": "tool-return", "tool_name": "weather", "content": {"temp_c": 4},
                 "tool_call_id": "call-1"},
                {"type": "Text", "text": "It is 4 °C in Oslo."},
            ],
        }
    ]  # fmt: skip


def test_every_spelling_of_a_part_converts_to_its_message() -> None:
    conversion = convert(spelled_turns())

    assert conversion.problems == []
    assert [(m.role, m.content) for m in conversion.messages] == [
        ("user", "What is the weather?"),
        ("assistant", "Let me look."),
        ("assistant", None),
        ("tool", '{"temp_c": 4}'),
        ("assistant", "It is 4 °C in Oslo."),
    ]


def test_the_viewer_reads_every_spelling_as_its_kind() -> None:
    view = legacy_turn_view(spelled_turns()[0])

    assert [p.kind for p in view.parts] == ["text", "tool_call", "tool_result", "text"]
    assert not any("Unknown part type" in p.title for p in view.parts)


def cli(wire_uri: str, db: Database[dict[str, Any]], *args: str) -> int:
    return main([args[0], "--uri", wire_uri, "--database", db.name, "--progress", "none"])


@pytest.mark.wire
def test_a_migration_of_every_spelling_verifies_with_exit_0(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_many(spelled_turns())

    assert cli(wire_uri, database, "run") == 0
    assert database[MESSAGES].count_documents({"conversation_id": CID}) == 5
    assert cli(wire_uri, database, "verify") == 0


@pytest.mark.wire
def test_a_150_character_user_id_keeps_its_conversation_through_the_migration(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    owner = "u" * 150
    database[CONVERSATIONS].insert_many(spelled_turns(user_id=owner))

    assert cli(wire_uri, database, "run") == 0

    conversation = database[CONVERSATIONS].find_one({"_id": CID})
    assert conversation is not None
    assert conversation["user_id"] == owner
    assert {m["user_id"] for m in database[MESSAGES].find({"conversation_id": CID})} == {owner}


@pytest.mark.wire
def test_an_is_system_read_as_neither_holds_the_drop_back_and_stores_the_users_message(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """The gate an operator trusts: `verify` finds the migration faithful (the turn is the
    user's), and `finish` says there is work left until the flag's problem is accepted."""
    database[CONVERSATIONS].insert_many(
        [{**t, "is_system": Decimal128("0.5")} for t in spelled_turns()]
    )

    assert cli(wire_uri, database, "run") == 0

    first = database[MESSAGES].find_one({"conversation_id": CID, "seq": 0})
    assert first is not None
    assert (first["role"], first["content"]) == ("user", "What is the weather?")
    assert [p["kind"] for p in database[PROBLEMS].find({"placed": False})] == ["unreadable_flag"]
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 1


@pytest.mark.parametrize(
    ("part", "field", "expected"),
    [
        ({"type": "text", "content": "", "text": "kept"}, "content", "kept"),
        ({"type": "text", "content": None, "text": "kept"}, "content", "kept"),
        ({"type": "tool_result", "result": None, "content": "kept"}, "result", "kept"),
        ({"type": "hitl", "prompt": "", "content": "kept"}, "content", "kept"),
        ({"type": "error", "message": "", "error": "kept"}, "content", "kept"),
        ({"type": "tool_call", "args": {}, "arguments": {"a": 1}}, "args", {"a": 1}),
        ({"type": "text", "content": ""}, "content", ""),
        ({"type": "tool_result", "result": None, "content": 0}, "result", 0),
    ],
)
def test_a_blank_spelling_yields_to_one_that_holds_the_value(
    part: dict[str, Any], field: str, expected: Any
) -> None:
    from agent_store.legacy._parts import normalize_part

    assert getattr(normalize_part(part), field) == expected


@pytest.mark.parametrize(
    ("flag", "system"),
    [("false", False), ("False", False), ("0", False), ("no", False), ("", False),
     (0, False), (None, False), ("true", True), ("1", True), (1, True), (True, True)],
)  # fmt: skip
def test_is_system_written_as_text_means_what_it_says(flag: Any, system: bool) -> None:
    turn = {**spelled_turns()[0], "is_system": flag}
    converted = convert([turn])
    assert (converted.messages[0].role == "system") is system


@pytest.mark.parametrize(
    ("flag", "system"),
    [(Decimal128("0"), False), (Decimal128("1"), True), (Int64(0), False), (Int64(1), True),
     ("0.0", False), (" 1.0 ", True), (0.0, False), (1.0, True), (" Yes ", True), ("off", False)],
)  # fmt: skip
def test_is_system_written_as_a_number_of_any_type_means_what_it_says(
    flag: Any, system: bool
) -> None:
    turn = {**spelled_turns()[0], "is_system": flag}
    converted = convert([turn])
    assert (converted.messages[0].role == "system") is system
    assert converted.problems == []
    assert legacy_turn_view(turn).is_system is system  # the viewer reads it alike


@pytest.mark.parametrize(
    "flag",
    [[False], {"on": False}, "disabled", 2, -1, float("nan"), Decimal128("NaN"), "0.5",
     Decimal128("2")],
)  # fmt: skip
def test_an_is_system_read_as_neither_yes_nor_no_is_a_problem_and_the_turn_stays_the_users(
    flag: Any,
) -> None:
    """Read as neither, the flag is kept in a problem for an operator to accept, and the turn
    converts as the user's, hidden runtime context stripped and kept: what a user wrote never
    becomes a system instruction on a guess."""
    hidden = "[RUNTIME CONTEXT]plan: refund[/RUNTIME CONTEXT]"
    turn = {**spelled_turns()[0], "is_system": flag, "user_message": f"What is it?{hidden}"}
    converted = convert([turn])

    assert (converted.messages[0].role, converted.messages[0].content) == ("user", "What is it?")
    kinds = {(p.kind, p.field, p.placed) for p in converted.problems}
    assert ("unreadable_flag", "is_system", False) in kinds
    assert ("hidden_runtime_context", "user_message", False) in kinds
    flagged = next(p for p in converted.problems if p.kind == "unreadable_flag")
    assert flagged.content == flag or flag != flag  # NaN is kept, though not equal to itself


def test_a_call_spelt_the_openai_way_keeps_its_id_as_the_call_id() -> None:
    """`id` beside `name` and `arguments` is the call's id (a Pydantic AI part's `id`, beside
    its `tool_call_id`, is the provider's bookkeeping)."""
    parts = [
        {"type": "tool_call", "id": "call_real_7Qx", "name": "lookup", "arguments": "{}"},
        {"type": "tool_result", "tool_call_id": "call_real_7Qx", "name": "lookup",
         "content": "found"},
    ]  # fmt: skip
    at = datetime(2024, 1, 1, tzinfo=UTC)
    turn = {"_id": "t-1", "conversation_id": "c-openai", "created_at": at,
            "user_message": "look it up", "response_parts": parts}  # fmt: skip

    messages = convert([turn]).messages

    [call] = [c for m in messages for c in m.tool_calls or ()]
    assert call.id == "call_real_7Qx"
    assert [m.tool_call_id for m in messages if m.role == "tool"] == ["call_real_7Qx"]


# -- the summary fields of a turn without parts, and its time, in every shape -----------------

T0 = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)


def turn(turn_id: str, conversation_id: str, n: int = 0, **fields: Any) -> dict[str, Any]:
    """A legacy turn of `conversation_id`, `n` minutes after T0, without parts."""
    return {"_id": turn_id, "conversation_id": conversation_id, "user_id": "alice",
            "created_at": T0 + timedelta(minutes=n), **fields}  # fmt: skip


def holding(db: Database[dict[str, Any]], collection: str, text: str) -> list[dict[str, Any]]:
    found = db[collection].find({"placed": False} if collection == PROBLEMS else {})
    return [d for d in found if text in json.dumps(d, default=str, ensure_ascii=False)]


@pytest.mark.parametrize(
    ("response_text", "content"),
    [(987654321, "987654321"), (12.5, "12.5"), (["on", "its way"], '["on", "its way"]'),
     ({"answer": 4}, '{"answer": 4}')],
    ids=["an integer", "a decimal", "a list of strings", "an object"],
)  # fmt: skip
def test_a_response_text_that_is_not_text_is_the_answer_as_its_json_text(
    response_text: Any, content: str
) -> None:
    """As a text part's content that is not text: a number is its decimal text."""
    conversion = convert([turn("t1", "c-answer", user_message="q", response_text=response_text)])

    assert [(m.role, m.content) for m in conversion.messages] == [
        ("user", "q"),
        ("assistant", content),
    ]
    assert conversion.problems == []


def test_a_response_text_that_is_not_text_beside_parts_is_compared_as_its_text() -> None:
    """`987654321` is the part's text `987654321`; `[42]` is no text of the parts."""
    parts = [{"type": "text", "content": "987654321"}]
    told = turn("t1", "c-answer", response_parts=parts, response_text=987654321)
    untold = turn("t2", "c-answer", 1, response_parts=parts, response_text=[42])

    problems = convert([told, untold]).problems

    assert [(p.legacy_id, p.kind, p.placed, p.content) for p in problems] == [
        ("t2", "response_text_not_in_parts", False, [42])
    ]


@pytest.mark.wire
def test_a_response_text_stored_as_a_number_is_migrated_and_verifies(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_many(
        [turn("t1", "c-number", user_message="what is the order number?", response_text=987654321)]
    )
    assert cli(wire_uri, database, "run") == 0

    [answer] = database[MESSAGES].find({"conversation_id": "c-number", "role": "assistant"})
    assert answer["content"] == "987654321"
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


OPENAI_CALL = {
    "id": "call_real_9Zk",
    "type": "function",
    "function": {"name": "issue_refund_zq", "arguments": '{"amount":5}'},
}


@pytest.mark.parametrize(
    ("tool_calls", "call"),
    [
        (["track_parcel_zq"], ("track_parcel_zq", "{}")),
        ({"tool_name": "issue_refund_zq", "args": {"amount": 5}},
         ("issue_refund_zq", '{"amount":5}')),
        ([OPENAI_CALL], ("issue_refund_zq", '{"amount":5}')),
        ([None, {"name": "issue_refund_zq", "arguments": {"amount": 5}}],
         ("issue_refund_zq", '{"amount":5}')),
    ],
    ids=["a list of tool names", "one object alone", "the OpenAI shape", "a null entry"],
)  # fmt: skip
def test_a_tool_calls_summary_of_names_or_objects_is_converted_to_its_calls(
    tool_calls: Any, call: tuple[str, str]
) -> None:
    """A name is a call whose arguments were not kept, as an object naming no `args` is."""
    conversion = convert([turn("t1", "c-calls", user_message="q", tool_calls=tool_calls)])

    calls = [c for m in conversion.messages for c in m.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in calls] == [call]
    assert conversion.problems == []


def test_the_openai_shape_of_a_summed_up_call_keeps_its_id_as_the_call_id() -> None:
    conversion = convert([turn("t1", "c-calls", user_message="q", tool_calls=[OPENAI_CALL])])

    assert [c.id for m in conversion.messages for c in m.tool_calls or ()] == ["call_real_9Zk"]


@pytest.mark.parametrize(
    ("tool_calls", "problem"),
    [
        ("track_parcel_zq", ("invalid_part", "tool_calls", None, "track_parcel_zq")),
        (42, ("invalid_part", "tool_calls", None, 42)),
        ([7], ("unknown_part", "response_parts", -1, 7)),
    ],
    ids=["a string", "a number", "an entry that is neither"],
)
def test_a_tool_calls_summary_no_call_is_read_from_is_kept_in_an_unplaced_problem(
    tool_calls: Any, problem: tuple[str, str, int | None, Any]
) -> None:
    """A string alone may be a tool's name or JSON text of calls: no one reading of it."""
    conversion = convert([turn("t1", "c-calls", user_message="q", tool_calls=tool_calls)])

    assert [(p.kind, p.field, p.part_index, p.content) for p in conversion.problems] == [problem]
    assert not any(p.placed for p in conversion.problems)
    assert not any(m.tool_calls for m in conversion.messages)


def test_a_tool_name_in_the_summary_is_held_by_a_part_calling_that_tool() -> None:
    parts = [{"type": "tool_call", "tool_name": "track_parcel_zq", "args": {"id": 1}}]
    summed = turn("t1", "c-calls", response_parts=parts, tool_calls=["track_parcel_zq", "other"])

    problems = convert([summed]).problems

    assert [(p.kind, p.content) for p in problems] == [("tool_call_not_in_parts", "other")]


@pytest.mark.wire
def test_a_tool_calls_summary_of_names_or_one_object_is_migrated_and_verifies(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_many(
        [
            turn("t1", "c-names", user_message="where is it?", response_text="on its way",
                 tool_calls=["track_parcel_zq"]),
            turn("t2", "c-object", user_message="refund me", response_text="done",
                 tool_calls={"tool_name": "issue_refund_zq", "args": {"amount": 5}}),
        ]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0

    for name in ("track_parcel_zq", "issue_refund_zq"):
        assert holding(database, MESSAGES, name), name
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
def test_a_tool_calls_summary_no_call_is_read_from_holds_finish_back(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    database[CONVERSATIONS].insert_many(
        [turn("t1", "c-text", user_message="where?", response_text="here",
              tool_calls="track_parcel_zq")]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0

    assert holding(database, PROBLEMS, "track_parcel_zq")
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 1


@pytest.mark.wire
def test_created_at_written_as_epoch_text_dates_and_orders_the_turns(
    wire_uri: str, database: Database[dict[str, Any]]
) -> None:
    """Stored later-first: the turns are migrated, verified and gated in time order."""
    database[CONVERSATIONS].insert_many(
        [
            turn("t2", "c-epoch", created_at="1614596400", user_message="second question",
                 response_text="second answer"),
            turn("t1", "c-epoch", created_at=" 1614592800 ", user_message="first question",
                 response_text="first answer"),
        ]
    )  # fmt: skip
    assert cli(wire_uri, database, "run") == 0

    stored = list(database[MESSAGES].find({"conversation_id": "c-epoch"}).sort("seq", 1))
    assert [m["content"] for m in stored] == [
        "first question", "first answer", "second question", "second answer"
    ]  # fmt: skip
    assert stored[0]["created_at"] == datetime(2021, 3, 1, 10, 0, tzinfo=UTC)
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == 0


@pytest.mark.wire
@pytest.mark.parametrize(("status", "pending", "finish"), [("rejected", False, 0),
                         ("Timed-Out", False, 0), ("awaiting approval", True, 0),
                         ("snoozed", True, 1)])  # fmt: skip
def test_a_prompt_status_says_answered_or_waiting_else_it_holds_the_drop(
    wire_uri: str, database: Database[dict[str, Any]], status: str, pending: bool, finish: int
) -> None:
    """A prompt the user rejected is not asked again after the migration; one whose status
    says neither stays pending and `finish` waits for an operator."""
    raised = {"type": "hitl", "action": "refund", "request_id": "req-r", "prompt": "Refund?"}
    database[CONVERSATIONS].insert_one({**spelled_turns()[0], "response_parts": [raised]})
    database[SESSION_HITL].insert_one(
        {"conversation_id": CID, "user_id": "user-spell", "request_id": "req-r",
         "action": "refund", "prompt": "Refund?", "status": status, "created_at": AT}
    )  # fmt: skip

    assert cli(wire_uri, database, "run") == 0

    conversation = database[CONVERSATIONS].find_one({"_id": CID})
    assert conversation is not None
    assert (conversation.get("pending_hitl") is not None) is pending
    assert cli(wire_uri, database, "verify") == 0
    assert cli(wire_uri, database, "finish") == finish
