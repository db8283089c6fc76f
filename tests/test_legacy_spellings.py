"""One reader of the legacy format: every spelling of a part means the same to the converter,
the migration's verify and the viewer; one identifier rule for users everywhere."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pymongo.database import Database

from agent_store.legacy import convert
from agent_store.store import CONVERSATIONS, MESSAGES
from app.presentation import legacy_turn_view
from migrations.cli import main

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


def test_a_call_spelt_the_openai_way_keeps_its_id_as_the_call_id() -> None:
    """`id` beside `name` and `arguments` is the call's id (a Pydantic AI part's `id`, beside
    its `tool_call_id`, is the provider's bookkeeping)."""
    parts = [
        {"type": "tool_call", "id": "call_real_7Qx", "name": "lookup", "arguments": "{}"},
        {"type": "tool_result", "tool_call_id": "call_real_7Qx", "name": "lookup",
         "content": "found"},
    ]  # fmt: skip
    turn = {"_id": "t-1", "conversation_id": "c-openai",
            "created_at": datetime(2024, 1, 1, tzinfo=UTC),
            "user_message": "look it up", "response_parts": parts}  # fmt: skip

    messages = convert([turn]).messages

    [call] = [c for m in messages for c in m.tool_calls or ()]
    assert call.id == "call_real_7Qx"
    assert [m.tool_call_id for m in messages if m.role == "tool"] == ["call_real_7Qx"]
