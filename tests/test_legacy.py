"""The legacy converter: golden example, each kind of mess, and properties over generated data."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from bson import Code, Decimal128, Int64, ObjectId
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent_store.core import AgentMessage, InvalidInput, message_adapter
from agent_store.legacy import (
    Problem,
    convert,
    legacy_turn_document,
    parse_turns,
    pending_from_session_hitl,
    with_session_prompts,
)
from agent_store.store import MAX_NAME_CHARS
from app.examples import EXAMPLE_CONVERSATION_ID, example_legacy_turns
from migrations.transcript import differences, from_legacy, from_legacy_converted, from_messages
from tests.test_logger import expected_example

CID = "legacy-conv"
T0 = datetime(2025, 5, 1, 12, 0, tzinfo=UTC)


def convert_conversation(turns: Any) -> tuple[list[AgentMessage], list[Problem]]:
    conversion = convert(turns)
    return conversion.messages, conversion.problems


def turn(n: int, parts: list[Any] | None = None, **fields: Any) -> dict[str, Any]:
    """A legacy turn document; `n` makes its id and its time."""
    return {
        "_id": ObjectId(f"{n:024x}"),
        "conversation_id": CID,
        "user_id": "user-1",
        "created_at": T0 + timedelta(minutes=n),
        "user_message": f"question {n}",
        "response_parts": parts if parts is not None else [],
        **fields,
    }


def shape(messages: list[AgentMessage]) -> list[tuple[Any, ...]]:
    """Role and the visible payload of each message."""
    return [
        (
            m.role,
            m.content,
            [(c.function.name, c.function.arguments) for c in m.tool_calls or ()] or None,
            m.tool_call_id,
            m.error.message if m.error else None,
        )
        for m in messages
    ]


def call_ids(messages: list[AgentMessage]) -> list[str]:
    return [c.id for m in messages for c in m.tool_calls or ()]


def test_example_conversation_as_legacy_turns_converts_to_its_twelve_messages() -> None:
    messages, problems = convert_conversation(example_legacy_turns())

    # Only what the user saw is a message; the runtime context stripped is kept in a problem.
    assert [(p.kind, p.placed, p.content) for p in problems] == [
        (
            "hidden_runtime_context",
            False,
            "[RUNTIME CONTEXT]timezone=Europe/Paris; plan=pro[/RUNTIME CONTEXT]",
        )
    ]
    assert len(messages) == 12
    assert [m.seq for m in messages] == list(range(12))
    ignored = {"id", "seq", "search_text", "created_at", "token_usage", "latency_ms"}
    ignored |= {"conversation_id", "user_id", "turn_id"}
    got = [m.model_dump(exclude=ignored) for m in messages]
    assert got == [{k: v for k, v in m.items() if k not in ignored} for m in expected_example()]
    # Usage was kept per turn: it lands on the turn's last assistant message.
    assert [m.token_usage.input_tokens for m in messages if m.token_usage] == [310, 540]
    assert {m.conversation_id for m in messages} == {EXAMPLE_CONVERSATION_ID}
    assert {m.user_id for m in messages} == {"user-ada"}


def test_example_conversation_document_sums_the_turns() -> None:
    conversion = convert(example_legacy_turns())
    conversation = conversion.conversation
    assert conversation is not None
    assert conversation.turn_count == 4
    assert conversation.message_count == 12
    assert conversation.usage.input_tokens == 850
    assert conversation.name == "Trip to Lyon"
    assert conversation.last_message_preview == "Booking service unavailable (HTTP 503)"
    assert conversation.turns == []
    assert conversation.updated_at == conversion.messages[-1].created_at


def test_converted_messages_validate_against_the_store_models() -> None:
    messages, _ = convert_conversation(example_legacy_turns())
    for message in messages:
        document = message.model_dump(by_alias=True)
        assert message_adapter.validate_python(document) == message


HITL_OBJECT_PROMPT = {
    "type": "hitl",
    "action": "refund",
    "request_id": "r-1",
    "prompt": {"title": "Refund o-1?", "body": "40 €"},
}

MESS: list[Any] = [
    pytest.param(
        [
            {"_id": ObjectId(f"{1:024x}"), "conversation_id": CID},
            {
                "_id": ObjectId(f"{2:024x}"),
                "conversation_id": CID,
                "response_parts": [{"type": "text", "content": "hello"}],
            },
        ],
        [("assistant", "hello", None, None, None)],
        ["missing_created_at", "missing_created_at"],
        id="missing-fields",
    ),
    pytest.param(
        [
            turn(
                1,
                [
                    {"type": "tool_call", "tool_name": "f", "args": '{"a": 1}'},
                    {"type": "tool_call", "tool_name": "g", "args": {"b": 2}},
                    {"type": "tool_result", "tool_name": "f", "result": 1},
                    {"type": "tool_result", "tool_name": "g", "result": 2},
                ],
            )
        ],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, [("f", '{"a": 1}'), ("g", '{"b":2}')], "#0", None),
            ("tool", "1", None, "#0", None),
            ("tool", "2", None, "#1", None),
        ],
        [],
        id="args-as-string-or-dict",
    ),
    pytest.param(
        [
            turn(
                1,
                [
                    {"type": "tool_call", "tool_name": "f", "args": {}},
                    {"type": "text", "content": "thinking"},
                    {"type": "tool_call", "tool_name": "g", "args": {}},
                    {"type": "text", "content": "done"},
                    {"type": "tool_result", "tool_name": "g", "result": "G"},
                    {"type": "tool_result", "tool_name": "f", "result": "F"},
                ],
            )
        ],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, [("f", "{}")], None, None),
            ("tool", "F", None, "#0", None),
            ("assistant", "thinking", None, None, None),
            ("assistant", None, [("g", "{}")], None, None),
            ("tool", "G", None, "#1", None),
            ("assistant", "done", None, None, None),
        ],
        [],
        id="trailing-results-move-right-after-their-calls",
    ),
    pytest.param(
        [
            turn(
                1,
                [
                    {"type": "tool_call", "tool_name": "f", "args": {"n": 1}},
                    {"type": "tool_call", "tool_name": "f", "args": {"n": 2}},
                    {"type": "tool_result", "tool_name": "f", "result": "one"},
                    {"type": "tool_result", "tool_name": "f", "result": "two"},
                ],
            )
        ],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, [("f", '{"n":1}'), ("f", '{"n":2}')], None, None),
            ("tool", "one", None, "#0", None),
            ("tool", "two", None, "#1", None),
        ],
        [],
        id="repeated-tool-names-pair-in-order-with-distinct-ids",
    ),
    pytest.param(
        [turn(1, [{"type": "tool_result", "tool_name": "f", "result": {"lost": "no"}}])],
        [("user", "question 1", None, None, None)],
        ["unplaced_tool_result"],
        id="result-without-call-goes-to-problems",
    ),
    pytest.param(
        [turn(1, [{"type": "tool_call", "tool_name": "f", "args": {}}])],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, [("f", "{}")], None, None),
        ],
        [],
        id="call-without-result-is-kept",
    ),
    pytest.param(
        [turn(1, [{"type": "thinking", "content": "hmm"}, {"type": "text", "content": "hi"}])],
        [("user", "question 1", None, None, None), ("assistant", "hi", None, None, None)],
        ["unknown_part"],
        id="unknown-part-type-goes-to-problems",
    ),
    pytest.param(
        [
            turn(
                1,
                [
                    {"type": "tool_call", "tool_name": "f", "args": {"at": T0}},
                    {
                        "type": "tool_result",
                        "tool_name": "f",
                        "result": {"when": T0, "id": ObjectId(f"{9:024x}"), "x": float("nan")},
                    },
                ],
            )
        ],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, [("f", '{"at":"2025-05-01T12:00:00+00:00"}')], None, None),
            (
                "tool",
                '{"when": "2025-05-01T12:00:00+00:00", "id": "000000000000000000000009", '
                '"x": "nan"}',
                None,
                "#0",
                None,
            ),
        ],
        ["non_json_value", "non_json_value"],
        id="non-json-values-in-results-become-strings",
    ),
    pytest.param(
        [
            turn(2, user_message="second, same time", created_at=T0),
            turn(1, user_message="first, same time", created_at=T0),
            turn(0, user_message="earliest", created_at=T0 - timedelta(seconds=1)),
        ],
        [
            ("user", "earliest", None, None, None),
            ("user", "second, same time", None, None, None),
            ("user", "first, same time", None, None, None),
        ],
        [],
        id="identical-created-at-keeps-stored-order",
    ),
    pytest.param(
        [turn(1, None, tool_calls=[{"tool_name": "f", "args": {}}], response_text="answer")],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, [("f", "{}")], None, None),
            ("assistant", "answer", None, None, None),
        ],
        [],
        id="no-parts-falls-back-to-summary-fields",
    ),
    pytest.param(
        [turn(1, [{"type": "text", "content": "a"}], response_text="something else")],
        [("user", "question 1", None, None, None), ("assistant", "a", None, None, None)],
        ["response_text_not_in_parts"],
        id="response-text-that-no-part-holds-is-reported",
    ),
    pytest.param(
        [turn(1, [{"type": "error"}, {"type": "tool_call", "args": {}}, "just a string"])],
        [
            ("user", "question 1", None, None, None),
            ("assistant", None, None, None, '{"type": "error"}'),
        ],
        ["invalid_part", "unknown_part"],
        id="malformed-parts-are-kept-as-problems",
    ),
    pytest.param(
        [turn(1, [HITL_OBJECT_PROMPT])],
        [
            ("user", "question 1", None, None, None),
            ("assistant", '{"title": "Refund o-1?", "body": "40 €"}', None, None, None),
        ],
        [],
        id="a-hitl-prompt-that-is-not-text-is-kept-as-its-json-text",
    ),
]


@pytest.mark.parametrize(("turns", "expected", "problem_kinds"), MESS)
def test_messy_legacy_data_converts_without_losing_content(
    turns: list[dict[str, Any]], expected: list[tuple[Any, ...]], problem_kinds: list[str]
) -> None:
    messages, problems = convert_conversation(turns)

    ids = call_ids(messages)
    resolved = [
        tuple(ids[int(v[1:])] if isinstance(v, str) and v.startswith("#") else v for v in row)
        for row in expected
    ]
    got = shape(messages)
    # "#n" in an expectation names the n-th tool call id of the conversation.
    assert [r[:3] + r[4:] for r in got] == [r[:3] + r[4:] for r in resolved]
    assert [r[3] for r in got if r[0] == "tool"] == [r[3] for r in resolved if r[0] == "tool"]
    assert [p.kind for p in problems] == problem_kinds
    assert len(set(ids)) == len(ids)
    for problem in problems:
        assert problem.conversation_id == CID


def test_verify_reads_a_hitl_prompt_that_is_not_text_as_the_converter_stores_it() -> None:
    turns = [turn(1, [{"type": "hitl", "action": "refund", "request_id": "r-1",
                       "prompt": {"title": "«Refund o-1?»"}}])]  # fmt: skip
    legacy = from_legacy(parse_turns(turns))

    assert differences(legacy, from_messages(convert(turns).messages)) == []
    assert any("«Refund o-1?»" in line for line in legacy.lines)


def test_verify_names_a_tool_result_by_the_call_it_answers() -> None:
    """A result part written the OpenAI way (its call id, no tool name, or another tool's
    name) answers the call of that id, in its turn or an earlier one: the legacy side of
    `verify` names it by that call, as the stored side does, so a correct migration matches."""
    call = {"type": "tool_call", "tool_name": "lookup", "args": {"key": "k"}}
    turns = [
        turn(1, [call | {"tool_call_id": "call_9"},
                 {"type": "tool_result", "tool_call_id": "call_9", "content": "v"},
                 call | {"tool_call_id": "call_8"}]),
        turn(2, [{"type": "tool_result", "tool_name": "search", "tool_call_id": "call_8",
                  "content": "w"}]),
    ]  # fmt: skip
    conversion = convert(turns)
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)

    assert differences(legacy, from_messages(conversion.messages)) == []
    assert "lookup -> w" in legacy.results


def test_name_set_on_some_turns_only_uses_the_last_name() -> None:
    turns = [turn(1, name="First"), turn(2), turn(3, name="Renamed"), turn(4, name="")]
    conversation = convert(turns).conversation
    assert conversation is not None
    assert (conversation.name, conversation.name_source) == ("Renamed", "runtime")


def test_a_name_longer_than_a_conversation_holds_is_cut_and_kept_whole_in_a_problem() -> None:
    name = "Budget review " + "https://intranet.example.com/finance/" + "q" * 230
    conversion = convert([turn(1, name=name)])

    assert conversion.conversation is not None
    stored = conversion.conversation.name or ""
    assert stored.startswith("Budget review")
    assert len(stored) <= MAX_NAME_CHARS
    assert [(p.kind, p.placed, p.field, p.content) for p in conversion.problems] == [
        ("shortened_name", True, "name", name)
    ]


def test_without_any_name_the_first_user_text_names_the_conversation() -> None:
    conversion = convert([turn(1), turn(2)])
    conversation = conversion.conversation
    assert conversation is not None
    assert (conversation.name, conversation.name_source) == ("question 1", "auto")
    # Its message recorded, as a turn records it: a pop of that message takes the name back.
    assert conversation.name_message_id == conversion.messages[0].id
    assert conversion.messages[0].content == "question 1"


def test_real_ids_from_parts_and_message_history_win_over_generated_ones() -> None:
    history = [
        {"parts": [{"part_kind": "tool-call", "tool_name": "f", "tool_call_id": "old_1"}]},
        {"parts": [{"part_kind": "tool-call", "tool_name": "f", "tool_call_id": "real_f"},
                   {"part_kind": "tool-call", "tool_name": "g", "tool_call_id": "real_g"}]},
        {"parts": [{"part_kind": "tool-return", "tool_name": "f", "tool_call_id": "real_f"}]},
    ]  # fmt: skip
    parts = [
        {"type": "tool_call", "tool_name": "f", "args": {}},
        {"type": "tool_call", "tool_name": "g", "args": {}},
        {"type": "tool_call", "tool_name": "h", "args": {}, "tool_call_id": "part_h"},
        {"type": "tool_result", "tool_name": "h", "result": "H", "tool_call_id": "part_h"},
        {"type": "tool_result", "tool_name": "f", "result": "F"},
    ]
    messages, problems = convert_conversation(
        [turn(1, parts, message_history_json=json.dumps(history))]
    )
    assert problems == []
    assert call_ids(messages) == ["real_f", "real_g", "part_h"]
    assert [m.tool_call_id for m in messages if m.role == "tool"] == ["real_f", "part_h"]


def test_a_real_id_reused_in_a_later_turn_gets_a_generated_one() -> None:
    call = {"type": "tool_call", "tool_name": "f", "args": {}, "tool_call_id": "call_0"}
    result = {"type": "tool_result", "tool_name": "f", "result": "r", "tool_call_id": "call_0"}
    messages, problems = convert_conversation([turn(1, [call, result]), turn(2, [call, result])])
    ids = call_ids(messages)
    assert ids[0] == "call_0"
    assert ids[1] != "call_0"
    assert [m.tool_call_id for m in messages if m.role == "tool"] == ids
    assert [p.kind for p in problems] == ["duplicate_tool_call_id"]


def test_a_result_naming_an_earlier_turns_call_is_placed_after_that_call() -> None:
    call = {"type": "tool_call", "tool_name": "approve", "args": {}, "tool_call_id": "call_a"}
    late = {"type": "tool_result", "tool_name": "approve", "result": "ok", "tool_call_id": "call_a"}
    messages, problems = convert_conversation([turn(1, [call]), turn(2, [late])])
    assert problems == []
    assert [m.role for m in messages] == ["user", "assistant", "tool", "user"]


def tool_call(name: str, call_id: str, **args: Any) -> dict[str, Any]:
    return {"type": "tool_call", "tool_name": name, "args": args, "tool_call_id": call_id}


def tool_result(name: str, call_id: str, value: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_name": name, "result": value, "tool_call_id": call_id}


def answers(messages: list[AgentMessage]) -> dict[str, Any]:
    return {m.tool_call_id: m.content for m in messages if m.role == "tool"}


def test_a_repeated_result_is_a_duplicate_never_the_answer_to_another_call() -> None:
    """A retried write recorded the Paris result twice: the Oslo call keeps its own answer,
    and the repeat is kept in a problem saying it repeats an answered call."""
    parts = [
        tool_call("weather", "a", city="Paris"),
        tool_call("weather", "b", city="Oslo"),
        tool_result("weather", "a", "Paris: sunny"),
        tool_result("weather", "a", "Paris: sunny"),
        tool_result("weather", "b", "Oslo: snow"),
    ]
    messages, problems = convert_conversation([turn(1, parts)])

    assert answers(messages) == {"a": "Paris: sunny", "b": "Oslo: snow"}
    assert [(p.kind, p.placed, p.part_index, p.content) for p in problems] == [
        ("duplicate_tool_result", False, 3, parts[3])
    ]
    assert "'a'" in problems[0].detail
    assert "already answered" in problems[0].detail


def test_a_result_naming_no_call_takes_only_the_call_no_result_names() -> None:
    """Results naming their call are paired first: a result whose id names no call, though
    it comes first, takes the call left unanswered, never the one another result names."""
    parts = [
        tool_call("weather", "a", city="A"),
        tool_call("weather", "b", city="B"),
        tool_result("weather", "zzz", "B: rain"),
        tool_result("weather", "a", "A: sun"),
    ]
    conversion = convert([turn(1, parts)])

    assert answers(conversion.messages) == {"a": "A: sun", "b": "B: rain"}
    assert [(p.kind, p.placed, p.content) for p in conversion.problems] == [
        ("replaced_id", True, "zzz")
    ]
    assert conversion.conversation is not None
    assert conversion.conversation.pending_calls == []
    legacy = from_legacy(parse_turns([turn(1, parts)]), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


@pytest.mark.parametrize("call_id", [None, "call_1"])
def test_a_results_own_id_its_call_does_not_name_is_kept_in_a_placed_problem(
    call_id: str | None,
) -> None:
    """A result naming an id of its own (a provider's `toolu_…`) that names no call is paired
    with its tool's call and stored under that call's id: its own id is kept in a placed
    `replaced_id` problem, never dropped silently with the legacy turns."""
    call = {"type": "tool_call", "tool_name": "fetch", "args": {"q": 1}}
    if call_id is not None:
        call["tool_call_id"] = call_id
    result = {"type": "tool_result", "tool_name": "fetch", "result": "ok",
              "tool_call_id": "toolu_01RealProviderId"}  # fmt: skip
    conversion = convert([turn(1, [call, result])])

    stored = call_ids(conversion.messages)
    assert len(stored) == 1
    assert call_id is None or stored == [call_id]
    assert [m.tool_call_id for m in conversion.messages if m.role == "tool"] == stored
    assert [(p.kind, p.placed, p.content) for p in conversion.problems] == [
        ("replaced_id", True, "toolu_01RealProviderId")
    ]


def test_an_id_the_converter_generates_is_never_one_a_call_of_the_conversation_named() -> None:
    """A call naming no id gets a generated `call_legacy_…` id; an earlier call naming that
    very id (forged, or two conversations' ids mixed) keeps it, and the generated one is
    another: no two calls of a conversation share an id."""
    unnamed = {"type": "tool_call", "tool_name": "fetch", "args": {"q": 2}}
    generated = call_ids(convert([turn(1), turn(2, [unnamed])]).messages)[0]

    conversion = convert([turn(1, [tool_call("fetch", generated, q=1)]), turn(2, [unnamed])])

    first, second = call_ids(conversion.messages)
    assert first == generated
    assert second != generated
    assert second.startswith("call_legacy_")


def test_a_result_id_reused_in_every_turn_answers_its_own_turns_call() -> None:
    """Results naming `call_0` in every turn, beside calls naming no id: each answers its own
    turn's call, as the order gives, none left pending or cut out of the transcript."""
    turns = [
        turn(n, [{"type": "tool_call", "tool_name": "weather", "args": {"city": city}},
                 tool_result("weather", "call_0", f"{city}: {n}C")])
        for n, city in ((1, "Oslo"), (2, "Rome"), (3, "Cairo"))
    ]  # fmt: skip
    conversion = convert(turns)

    assert [m.content for m in conversion.messages if m.role == "tool"] == [
        "Oslo: 1C", "Rome: 2C", "Cairo: 3C",
    ]  # fmt: skip
    assert conversion.conversation is not None
    assert conversion.conversation.pending_calls == []
    assert all(p.placed for p in conversion.problems)


def test_a_result_answers_the_call_of_its_id_in_its_own_turn_before_an_earlier_one() -> None:
    """A provider numbering calls per response reuses `call_0`: the first turn's call got no
    result, the second turn's result answers the second turn's call, right after it."""
    turns = [
        turn(1, [tool_call("search", "call_0", q="cats"), {"type": "text", "content": "failed"}]),
        turn(5, [tool_call("search", "call_0", q="cats"), tool_result("search", "call_0", "3"),
                 {"type": "text", "content": "found 3"}]),
    ]  # fmt: skip
    messages, problems = convert_conversation(turns)

    assert [(m.role, m.content) for m in messages] == [
        ("user", "question 1"), ("assistant", None), ("assistant", "failed"),
        ("user", "question 5"), ("assistant", None), ("tool", "3"), ("assistant", "found 3"),
    ]  # fmt: skip
    assert messages[5].tool_call_id == call_ids(messages)[1] != "call_0"
    assert [p.kind for p in problems] == ["duplicate_tool_call_id"]
    conversation = convert(turns).conversation
    assert conversation is not None
    assert [c.tool_call_id for c in conversation.pending_calls] == ["call_0"]


def test_a_result_answers_the_latest_unanswered_call_of_its_id() -> None:
    """As the live store pairs them (`answers_to_calls`): a second result of a reused id
    answers the earlier call still unanswered."""
    turns = [
        turn(1, [tool_call("f", "call_0")]),
        turn(2, [tool_call("f", "call_0"), tool_result("f", "call_0", "late"),
                 tool_result("f", "call_0", "early")]),
    ]  # fmt: skip
    messages, problems = convert_conversation(turns)

    first, second = call_ids(messages)
    assert answers(messages) == {first: "early", second: "late"}
    assert [p.kind for p in problems] == ["duplicate_tool_call_id"]


def test_two_calls_of_one_id_in_one_turn_are_answered_in_the_order_they_were_made() -> None:
    """A provider numbering calls per response calls one tool twice under one id: within a
    turn, results answer the calls in the order they were made (the latest unanswered call
    of an id is taken only across turns)."""
    turns = [
        turn(1, [tool_call("f", "call_0"), tool_call("f", "call_0"),
                 tool_result("f", "call_0", "first"), tool_result("f", "call_0", "second")]),
    ]  # fmt: skip
    messages, problems = convert_conversation(turns)

    first, second = call_ids(messages)
    assert answers(messages) == {first: "first", second: "second"}
    assert [p.kind for p in problems] == ["duplicate_tool_call_id"]


def test_results_under_one_id_answer_the_call_of_the_tool_they_name() -> None:
    turns = [
        turn(1, [tool_call("search", "call_0"), tool_call("book", "call_0"),
                 tool_result("book", "call_0", "booked"),
                 tool_result("search", "call_0", "found")]),
    ]  # fmt: skip
    messages, problems = convert_conversation(turns)

    tool_of = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    answered = {tool_of[str(m.tool_call_id)]: m.content for m in messages if m.role == "tool"}
    assert answered == {"search": "found", "book": "booked"}
    assert [p.kind for p in problems] == ["duplicate_tool_call_id"]


def test_the_transcript_pairs_results_under_one_id_with_calls_as_the_converter_does() -> None:
    """Two tools called under one id, each answered: both transcripts name each result by
    the call the one pairing rule gives it, so a right conversion shows no difference."""
    turns = [
        turn(1, [tool_call("search", "x", q="A"), tool_call("pay", "x", amount=5),
                 tool_result("pay", "x", "PAID"), tool_result("search", "x", "FOUND")]),
    ]  # fmt: skip
    conversion = convert(turns)

    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert legacy.results == ("pay -> PAID", "search -> FOUND")
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_a_result_under_an_empty_id_before_its_calls_answers_its_tools_call_on_both_sides() -> None:
    """An empty `tool_call_id` names no call, on a call as on a result: a `calc` result
    written before a `search` call under `""` and a `calc` call naming no id answers the
    `calc` call, in the stored messages and in the gate's transcript alike, so a right
    migration shows no difference (was: the gate paired it with `search` by the empty id)."""
    parts = [
        {"type": "tool_result", "tool_name": "calc", "result": None, "tool_call_id": ""},
        {"type": "tool_call", "tool_name": "search", "args": {"q": 1}, "tool_call_id": ""},
        {"type": "tool_call", "tool_name": "calc", "args": {"q": 2}},
    ]
    conversion = convert([turn(1, parts)])

    assert answered_by_tool(conversion.messages) == {"calc": "null"}
    assert conversion.problems == []
    legacy = from_legacy(parse_turns([turn(1, parts)]), conversion.unplaced)
    assert legacy.results == ("calc -> null",)
    assert differences(legacy, from_messages(conversion.messages)) == []


PAIRING_IDS = [None, "", "a", "b"]
"""The ids a generated call or result names: none, empty, or one of two shared by several."""


@st.composite
def calls_and_results(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Legacy turns of tool calls and results in any order (results before their calls too),
    naming ids missing, empty or repeated, results naming the tool of one call of several,
    another tool or none; a turn's `message_history_json` may give its calls ids of the pool,
    of their tool or not, and return results under them."""
    turns = []
    for n in range(1, draw(st.integers(1, 3)) + 1):
        parts: list[dict[str, Any]] = []
        for k in range(draw(st.integers(1, 6))):
            call_id = draw(st.sampled_from(PAIRING_IDS))
            if draw(st.booleans()):
                part = {"type": "tool_call", "tool_name": draw(st.sampled_from(TOOLS)),
                        "args": {"k": f"{n}.{k}"}}  # fmt: skip
            else:
                part = {"type": "tool_result", "result": f"r{n}.{k}"}
                if (tool := draw(st.sampled_from([*TOOLS, None]))) is not None:
                    part["tool_name"] = tool
            if call_id is not None:
                part["tool_call_id"] = call_id
            parts.append(part)
        history: list[dict[str, Any]] = []
        for part in parts if draw(st.booleans()) else ():
            if part["type"] == "tool_call" or draw(st.booleans()):
                history.append(history_part(part, draw(st.sampled_from(TOOLS)),
                                            draw(st.sampled_from(["a", "b", "h"]))))  # fmt: skip
        fields = {"message_history_json": json.dumps([{"parts": history}])} if history else {}
        turns.append(turn(n, parts, **fields))
    return turns


def history_part(part: dict[str, Any], tool: str, call_id: str) -> dict[str, Any]:
    """A history's call of `tool` under `call_id` with a call part's arguments, or its return
    of a result part's value, of the tool the part names."""
    if part["type"] == "tool_call":
        return {"part_kind": "tool-call", "tool_name": tool, "args": part["args"],
                "tool_call_id": call_id}  # fmt: skip
    return {"part_kind": "tool-return", "tool_name": part.get("tool_name", tool),
            "content": part["result"], "tool_call_id": call_id}  # fmt: skip


def history_tells_the_return_of_the_last_of_three_calls_under_one_id() -> list[dict[str, Any]]:
    """Turn 1's history gives its four `f` calls, naming no id, the ids `b`, `a`, `a`, `a`
    and returns its result, naming none, under `a`: that of the latest call of `a`, the
    fourth. Turn 2's result of `g` under `b` then finds the first call, of `f`, unanswered."""
    calls = [{"type": "tool_call", "tool_name": "f", "args": {"k": f"1.{k}"}} for k in range(4)]
    result = {"type": "tool_result", "tool_name": "f", "result": "r1.4"}
    ids = ["b", "a", "a", "a"]
    history = [history_part(call, "f", call_id) for call, call_id in zip(calls, ids, strict=True)]
    history.append(history_part(result, "f", "a"))
    return [
        turn(1, [*calls, result], message_history_json=json.dumps([{"parts": history}])),
        turn(2, [{"type": "tool_result", "tool_name": "g", "tool_call_id": "b", "result": "r2.0"}]),
    ]  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls_and_results())
@example(history_tells_the_return_of_the_last_of_three_calls_under_one_id())
def test_the_gate_pairs_every_tool_result_with_the_call_the_converter_stores_it_under(
    turns: list[dict[str, Any]],
) -> None:
    """The converter and the gate's transcript pair results with calls by one rule: however
    ids are missing, empty or repeated, results come before their calls or name the tool of
    one call of several, a conversion shows no difference to `verify`."""
    conversion = convert(turns)
    legacy = from_legacy_converted(parse_turns(turns), conversion)
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_a_history_return_leaves_the_calls_it_skips_to_later_results_on_both_sides() -> None:
    """Turn 1's history returns its result, naming no id, under `a`, the latest of three
    calls it gives `a`: the result answers the fourth call, leaving the first, `b`, open, so
    turn 2's `g` result under `b` answers it (by its id alone: `ambiguous_tool_result`).
    `verify` is told the same return, so it pairs both results alike (was: it paired turn
    1's result with the first call of `f`, found `b` answered and named turn 2's result by
    `g`, a difference no acceptance cleared)."""
    turns = history_tells_the_return_of_the_last_of_three_calls_under_one_id()
    conversion = convert(turns)

    first, *_, fourth = call_ids(conversion.messages)
    assert answers(conversion.messages) == {fourth: "r1.4", first: "r2.0"}
    assert [p.kind for p in conversion.unplaced] == ["ambiguous_tool_result"]
    legacy = from_legacy_converted(parse_turns(turns), conversion)
    assert legacy.results == ("f -> r1.4", "f -> r2.0")
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_a_result_its_id_pairs_with_a_call_only_the_history_names_is_so_on_both_sides() -> None:
    """Turn 1's history gives its `f` call, naming no id, the id `a`; turn 2's result of `g`
    under `a` is paired by that id alone with that call (a guess, `ambiguous_tool_result`,
    which an operator accepts): `verify` pairs it with the same call, by the ids the
    conversion says the histories gave, so once accepted nothing holds the drop (was: the
    gate, knowing no id `a`, named it by `g`, a difference no acceptance cleared)."""
    history = [{"parts": [{"part_kind": "tool-call", "tool_name": "f", "args": {"k": 1},
                           "tool_call_id": "a"}]}]  # fmt: skip
    turns = [
        turn(1, [{"type": "tool_call", "tool_name": "f", "args": {"k": 1}}],
             message_history_json=json.dumps(history)),
        turn(2, [tool_result("g", "a", "G")]),
    ]  # fmt: skip
    conversion = convert(turns)

    assert answered_by_tool(conversion.messages) == {"f": "G"}
    assert [p.kind for p in conversion.unplaced] == ["ambiguous_tool_result"]
    legacy = from_legacy_converted(parse_turns(turns), conversion)
    assert legacy.results == ("f -> G",)
    assert differences(legacy, from_messages(conversion.messages)) == []


BALANCE = "BALANCE: 120 EUR"
TRANSFER = "TRANSFER OK: 100 EUR to Bob"


def balance_then_transfer(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A provider numbering calls per response: turn 1 calls `get_balance` as `call_0`,
    turn 2 `transfer_funds` as `call_0` too, and turn 2's parts hold `results`."""
    return [
        turn(1, [tool_call("get_balance", "call_0")]),
        turn(2, [tool_call("transfer_funds", "call_0", to="Bob", eur=100), *results,
                 {"type": "text", "content": "Done."}]),
    ]  # fmt: skip


EACH_BY_ITS_OWN_RESULT = {"get_balance": BALANCE, "transfer_funds": TRANSFER}
"""The balance answered by the balance, the transfer by the transfer (`answered_by_tool`)."""


def answered_by_tool(messages: list[AgentMessage]) -> dict[str, Any]:
    """Each tool message's content by the tool of the call it answers."""
    tool_of = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    return {tool_of[str(m.tool_call_id)]: m.content for m in messages if m.role == "tool"}


@pytest.mark.parametrize("balance_first", [True, False], ids=["balance first", "transfer first"])
def test_results_under_an_id_reused_across_turns_answer_the_call_of_the_tool_they_name(
    balance_first: bool,
) -> None:
    """The tool a result names decides among the calls its id names before position does,
    across turns as within one: whatever the order of the parts, the balance answers the
    balance, right after its call in turn 1, and the transfer answers the transfer."""
    results = [tool_result("get_balance", "call_0", BALANCE),
               tool_result("transfer_funds", "call_0", TRANSFER)]  # fmt: skip
    turns = balance_then_transfer(results if balance_first else results[::-1])
    conversion = convert(turns)

    assert answered_by_tool(conversion.messages) == EACH_BY_ITS_OWN_RESULT
    assert [(m.role, m.content) for m in conversion.messages] == [
        ("user", "question 1"), ("assistant", None), ("tool", BALANCE),
        ("user", "question 2"), ("assistant", None), ("tool", TRANSFER), ("assistant", "Done."),
    ]  # fmt: skip
    assert [p.kind for p in conversion.problems] == ["duplicate_tool_call_id"]
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_a_repeated_result_of_a_reused_id_is_a_duplicate_never_another_tools_answer() -> None:
    """Turn 2 repeats turn 1's balance under `call_0`, the id of its own transfer: the
    repeat names a tool whose call is answered, so it is a duplicate, and the transfer keeps
    its own answer."""
    turns = balance_then_transfer([tool_result("get_balance", "call_0", BALANCE),
                                   tool_result("transfer_funds", "call_0", TRANSFER)])  # fmt: skip
    turns[0]["response_parts"].append(tool_result("get_balance", "call_0", BALANCE))
    conversion = convert(turns)

    assert answered_by_tool(conversion.messages) == EACH_BY_ITS_OWN_RESULT
    assert [(p.kind, p.placed, p.part_index) for p in conversion.problems] == [
        ("duplicate_tool_call_id", True, 0),
        ("duplicate_tool_result", False, 1),
    ]


def test_a_result_naming_no_tool_its_reused_id_calls_is_a_guess_that_holds_the_drop() -> None:
    """`call_0` names an unanswered call of `get_balance` and one of `transfer_funds`; a
    result naming `refund` answers neither by its name: the message answers the call the
    order gives (turn 2's), and an `ambiguous_tool_result` problem, not placed, keeps the
    result and the calls it could answer, so verify shows no difference and the drop waits."""
    result = tool_result("refund", "call_0", "REFUNDED")
    conversion = convert(balance_then_transfer([result]))

    assert answered_by_tool(conversion.messages) == {"transfer_funds": "REFUNDED"}
    found = [(p.kind, p.placed, p.field, p.part_index) for p in conversion.problems]
    assert found == [
        ("duplicate_tool_call_id", True, "response_parts", 0),
        ("ambiguous_tool_result", False, "response_parts", 1),
    ]
    ambiguous = conversion.problems[1]
    assert ambiguous.content["result"] == result
    assert sorted(c["tool_name"] for c in ambiguous.content["calls"]) == [
        "get_balance",
        "transfer_funds",
    ]
    legacy = from_legacy(parse_turns(balance_then_transfer([result])), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_a_result_naming_another_tool_than_the_one_open_call_of_its_reused_id_is_placed() -> None:
    """Turn 1's balance is answered: `call_0` names one unanswered call, so a result naming
    another tool answers it unambiguously, and a placed `mismatched_tool_name` keeps it."""
    turns = balance_then_transfer([tool_result("refund", "call_0", "REFUNDED")])
    turns[0]["response_parts"].append(tool_result("get_balance", "call_0", BALANCE))
    conversion = convert(turns)

    assert answered_by_tool(conversion.messages) == {
        "get_balance": BALANCE,
        "transfer_funds": "REFUNDED",
    }
    assert [(p.kind, p.placed) for p in conversion.problems] == [
        ("duplicate_tool_call_id", True),
        ("mismatched_tool_name", True),
    ]


@pytest.mark.parametrize("stray_first", [True, False], ids=["stray first", "stray last"])
def test_a_result_naming_its_calls_tool_answers_it_before_one_naming_another_tool(
    stray_first: bool,
) -> None:
    """One call `search` under id `a`, and two results under `a`, one naming `search`, one
    naming `delete_account`: the tool a result names decides before position, whatever the
    order of the parts, so `search`'s own result answers the call and the other is the
    problem, kept whole and holding the drop; verify sees the same pairing."""
    real, stray = tool_result("search", "a", "REAL"), tool_result("delete_account", "a", "STRAY")
    turns = [turn(1, [tool_call("search", "a", q="x"), *([stray, real] if stray_first else
                                                         [real, stray])])]  # fmt: skip
    conversion = convert(turns)

    assert answers(conversion.messages) == {"a": "REAL"}
    stray_index = 1 if stray_first else 2
    assert [(p.kind, p.placed, p.part_index, p.content) for p in conversion.problems] == [
        ("duplicate_tool_result", False, stray_index, stray)
    ]
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_a_result_naming_its_calls_tool_exactly_answers_it_before_one_naming_it_otherwise() -> None:
    """Under `call_0`, reused per response, turn 2's parts hold `Get_Balance`'s result (a
    name no call is of: tool names are compared exactly) before `transfer_funds`'s: the
    transfer's own result answers the transfer; the other, paired by its id alone with turn
    1's call, is a guess kept in an `ambiguous_tool_result` problem holding the drop."""
    turns = balance_then_transfer([tool_result("Get_Balance", "call_0", BALANCE),
                                   tool_result("transfer_funds", "call_0", TRANSFER)])  # fmt: skip
    conversion = convert(turns)

    assert answered_by_tool(conversion.messages) == EACH_BY_ITS_OWN_RESULT
    assert [(p.kind, p.placed, p.part_index) for p in conversion.problems] == [
        ("duplicate_tool_call_id", True, 0),
        ("ambiguous_tool_result", False, 1),
    ]
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


@pytest.mark.parametrize(
    ("name", "kinds"),
    [
        ("get_balance", []),
        (None, []),
        ("refund", [("ambiguous_tool_result", False, 1)]),
    ],
    ids=["its call's tool", "no tool (the OpenAI way)", "another tool"],
)
def test_a_later_turns_result_answers_an_earlier_turns_call_only_by_naming_its_tool(
    name: str | None, kinds: list[tuple[str, bool, int]]
) -> None:
    """A result in turn 2's parts whose id names only turn 1's call (`call_0`, reused per
    response) is placed right after that call when it names that call's tool, or none; naming
    another tool, moving it into turn 1 is a guess the id alone makes: an
    `ambiguous_tool_result` problem, not placed, holds the drop."""
    result = {"type": "tool_result", "result": "R", "tool_call_id": "call_0"}
    if name is not None:
        result["tool_name"] = name
    turns = [
        turn(1, [tool_call("get_balance", "call_0")]),
        turn(2, [{"type": "text", "content": "ok"}, result]),
    ]
    conversion = convert(turns)

    assert [m.role for m in conversion.messages] == [
        "user", "assistant", "tool", "user", "assistant"
    ]  # fmt: skip
    assert [(p.kind, p.placed, p.part_index) for p in conversion.problems] == kinds
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_verify_names_a_result_by_the_tool_it_names_when_its_id_calls_that_tool() -> None:
    """Stored messages pairing each result with the other tool's call (both under `call_0`)
    differ from the legacy turns: the legacy side names a result by the tool it names itself
    whenever its id names a call of that tool, so a pairing at odds with the parts shows."""
    turns = balance_then_transfer([tool_result("get_balance", "call_0", BALANCE),
                                   tool_result("transfer_funds", "call_0", TRANSFER)])  # fmt: skip
    conversion = convert(turns)
    swapped = {BALANCE: TRANSFER, TRANSFER: BALANCE}
    tampered = [
        m.model_copy(update={"content": swapped[str(m.content)]}) if m.role == "tool" else m
        for m in conversion.messages
    ]

    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert legacy.results == (f"get_balance -> {BALANCE}", f"transfer_funds -> {TRANSFER}")
    assert differences(legacy, from_messages(tampered)) != []


def test_each_upload_part_is_a_message_even_when_two_are_identical() -> None:
    upload = {"type": "file_upload", "filename": "invoice.pdf", "file_type": "application/pdf",
              "size": 2048}  # fmt: skip
    turns = [turn(1, [upload, dict(upload), {"type": "text", "content": "ok"}])]
    messages, problems = convert_conversation(turns)

    assert [m.upload.filename if m.upload else None for m in messages] == [
        "invoice.pdf", "invoice.pdf", None
    ]  # fmt: skip
    assert problems == []
    assert differences(from_legacy(parse_turns(turns)), from_messages(messages)) == []


def test_only_the_part_repeating_the_upload_result_is_skipped() -> None:
    """The old service recorded a turn's upload as `upload_result` and as a part: one upload;
    a second identical part is a second one."""
    body = {"filename": "a.txt", "file_type": "text/plain", "size": 3}
    turns = [turn(1, [{"type": "file_upload", **body}] * 2, upload_result=body)]
    messages, problems = convert_conversation(turns)

    assert [m.upload.filename for m in messages if m.upload] == ["a.txt", "a.txt"]
    assert problems == []
    assert differences(from_legacy(parse_turns(turns)), from_messages(messages)) == []


def test_runtime_context_is_stripped_from_legacy_user_text() -> None:
    text = "[RUNTIME CONTEXT]secret=1[/RUNTIME CONTEXT]Hello"
    messages, _ = convert_conversation([turn(1, user_message=text)])
    assert messages[0].content == "Hello"
    assert "secret" not in (messages[0].search_text or "")


def test_verify_sees_the_runtime_context_left_out_of_a_message_only_in_its_problem() -> None:
    """`verify` renders the legacy user message as it was written: the runtime context
    stripped from it is left out only where the converter recorded it as not placed, so a
    context that vanished from both sides unrecorded is a difference."""
    turns = [turn(1, user_message="[RUNTIME CONTEXT]secret=1[/RUNTIME CONTEXT]Hello")]
    conversion = convert(turns)
    legacy, new = parse_turns(turns), from_messages(conversion.messages)

    assert differences(from_legacy(legacy, conversion.unplaced), new) == []
    assert differences(from_legacy(legacy), new) == [
        "line 0: legacy has 'user: [RUNTIME CONTEXT]secret=1[/RUNTIME CONTEXT]Hello'",
        "line 0: new has 'user: Hello'",
    ]


def test_pending_prompt_comes_from_session_hitl() -> None:
    messages, _ = convert_conversation(example_legacy_turns())
    session = [
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-booking-1",
         "action": "confirm_booking", "status": "pending", "created_at": T0},
        {"conversation_id": EXAMPLE_CONVERSATION_ID, "request_id": "req-old", "resolved": True},
    ]  # fmt: skip
    pending, notes = pending_from_session_hitl(session, messages)
    assert notes == []
    assert pending is not None
    assert pending.request_id == "req-booking-1"
    assert pending.message_id == messages[8].id
    assert pending.prompt == messages[8].content
    assert pending_from_session_hitl(session[1:], messages) == (None, [])


PROMPT = {"conversation_id": CID, "action": "refund", "prompt": "Refund «o-1»?"}


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": 4711},
        {"request_id": "req-9", "resolved": "false"},
        {"request_id": "req-9", "resolved": "no", "status": " Pending "},
    ],
    ids=["a numeric request id", "resolved false as text", "status in other case and spaces"],
)
def test_a_session_prompt_written_with_odd_values_is_still_pending(fields: dict[str, Any]) -> None:
    """`session_hitl` is read as turns are: "false" is false, a request id by its text."""
    messages = convert([turn(1)]).messages
    pending, _ = pending_from_session_hitl([{**PROMPT, **fields}], messages)

    assert pending is not None
    assert (pending.request_id, pending.prompt) == (str(fields["request_id"]), "Refund «o-1»?")


@pytest.mark.parametrize("resolved", [Decimal128("0"), "0.0", Int64(0), 0.0, " No "])
def test_a_session_prompt_resolved_no_as_a_number_of_any_type_is_still_pending(
    resolved: Any,
) -> None:
    messages = convert([turn(1)]).messages
    prompt = {**PROMPT, "request_id": "req-9", "resolved": resolved}
    pending, notes = pending_from_session_hitl([prompt], messages)

    assert pending is not None
    assert pending.request_id == "req-9"
    assert "unreadable_flag" not in {n.kind for n in notes}


@pytest.mark.parametrize("resolved", [[False], {"on": False}, "later", 2, Decimal128("NaN")])
def test_a_session_prompt_resolved_neither_yes_nor_no_stays_pending_and_is_a_problem(
    resolved: Any,
) -> None:
    """Its status decides (pending), and the flag is kept in a problem an operator accepts:
    a prompt awaiting its answer is never dropped on a guess."""
    messages = convert([turn(1)]).messages
    prompt = {**PROMPT, "request_id": "req-9", "resolved": resolved}
    pending, notes = pending_from_session_hitl([prompt], messages)

    assert pending is not None
    assert pending.request_id == "req-9"
    assert ("unreadable_flag", "resolved", False) in {(n.kind, n.field, n.placed) for n in notes}


@pytest.mark.parametrize("status", ["Resolved ", " ANSWERED"])
def test_a_session_prompt_resolved_in_other_case_or_spaces_is_not_pending(status: str) -> None:
    messages = convert([turn(1)]).messages
    prompt = {**PROMPT, "request_id": "req-9", "status": status}
    assert pending_from_session_hitl([prompt], messages) == (None, [])


RAISED = {"type": "hitl", "action": "refund", "request_id": "req-9", "prompt": "Refund «o-1»?"}


ASKED = {**PROMPT, "request_id": "req-9", "status": "pending", "created_at": T0}
LATER = T0 + timedelta(minutes=2)
ANSWERED = {**PROMPT, "request_id": "req-9", "status": "approved", "resolved": True,
            "created_at": LATER, "updated_at": LATER}  # fmt: skip


@pytest.mark.parametrize(
    "answer",
    [ANSWERED, {**ANSWERED, "created_at": T0, "updated_at": T0 + timedelta(minutes=2)},
     {**ANSWERED, "created_at": T0, "updated_at": None}],
    ids=["recorded after", "updated after", "at the same time"],
)  # fmt: skip
def test_a_request_recorded_pending_then_answered_is_answered(answer: dict[str, Any]) -> None:
    """A request recorded more than once (one request id) is decided by its newest record:
    a pending record older than its answer is the ask the answer answered, never asked
    again."""
    messages = convert([turn(1, [RAISED])]).messages

    assert pending_from_session_hitl([ASKED, answer], messages) == (None, [])
    assert pending_from_session_hitl([answer, ASKED], messages) == (None, [])


@pytest.mark.parametrize(
    "asked",
    [{**ASKED, "created_at": T0 + timedelta(minutes=5)}, {**ASKED, "created_at": None}],
    ids=["pending after its answer", "pending undated"],
)
def test_a_request_recorded_pending_after_its_answer_is_a_problem_holding_the_gate(
    asked: dict[str, Any],
) -> None:
    """A pending record newer than the request's answer, or one that cannot be dated against
    it, contradicts it: the converter cannot tell, so it asks no approval already given and
    keeps the pending record in a problem (not placed) an operator accepts."""
    messages = convert([turn(1, [RAISED])]).messages
    pending, notes = pending_from_session_hitl([ANSWERED, asked], messages)

    assert pending is None
    [note] = notes
    assert (note.kind, note.placed, note.content) == ("contradictory_prompt_state", False, asked)
    assert "req-9" in note.detail


@pytest.mark.parametrize(
    "status",
    ["rejected", "approved", "Denied", "declined", "timed_out", "Timed Out", "time-out", "timeout",
     "closed", " ACCEPTED ", "failed", "expired", "cancelled", "completed"],
)  # fmt: skip
def test_a_session_prompt_whose_status_says_it_was_answered_or_is_over_is_not_pending(
    status: str,
) -> None:
    """A rejected refund is not asked again: any word saying the prompt was answered or is
    over, in any case, with spaces, underscores or hyphens, is answered."""
    messages = convert([turn(1)]).messages
    prompt = {**PROMPT, "request_id": "req-9", "status": status}
    assert pending_from_session_hitl([prompt], messages) == (None, [])


@pytest.mark.parametrize(
    "status",
    ["pending", " Open ", "waiting", "awaiting_approval", "Awaiting input", "asked", "new", "",
     None],
)  # fmt: skip
def test_a_session_prompt_whose_status_says_it_waits_is_pending_without_a_problem(
    status: str | None,
) -> None:
    messages = convert([turn(1, [RAISED])]).messages
    pending, notes = pending_from_session_hitl(
        [{**PROMPT, "request_id": "req-9", "status": status}], messages
    )
    assert pending is not None
    assert (pending.request_id, notes) == ("req-9", [])


@pytest.mark.parametrize("status", ["snoozed", "in_review", 3, ["approved"], {"state": "done"}])
def test_a_session_prompt_whose_status_is_no_known_word_stays_pending_and_is_a_problem(
    status: Any,
) -> None:
    """No guess: the prompt stays pending, as for a `resolved` read as neither yes nor no,
    and the status is kept in a problem (not placed) the drop waits on."""
    messages = convert([turn(1, [RAISED])]).messages
    pending, notes = pending_from_session_hitl(
        [{**PROMPT, "request_id": "req-9", "status": status}], messages
    )
    assert pending is not None
    assert pending.request_id == "req-9"
    found = [(n.kind, n.field, n.placed, n.content) for n in notes]
    assert found == [("unreadable_status", "status", False, status)]


def test_a_session_prompt_resolved_yes_with_a_status_no_one_reads_is_answered() -> None:
    """`resolved: true` says it was answered: the status then decides nothing."""
    messages = convert([turn(1, [RAISED])]).messages
    prompt = {**PROMPT, "request_id": "req-9", "status": "snoozed", "resolved": True}
    assert pending_from_session_hitl([prompt], messages) == (None, [])


def test_a_session_prompt_without_a_time_gets_the_same_one_on_every_run() -> None:
    messages = convert([turn(1), turn(2)]).messages
    prompt = {**PROMPT, "request_id": "req-9"}
    first, _ = pending_from_session_hitl([prompt], messages)
    again, _ = pending_from_session_hitl([prompt], messages)

    assert first is not None
    assert again is not None
    assert first.created_at == again.created_at == messages[-1].created_at


def test_a_session_prompt_with_a_time_written_as_text_keeps_it() -> None:
    messages = convert([turn(1)]).messages
    prompt = {**PROMPT, "request_id": "req-9", "created_at": "2025-05-01T12:30:00Z"}
    pending, _ = pending_from_session_hitl([prompt], messages)
    assert pending is not None
    assert pending.created_at == T0 + timedelta(minutes=30)


def unplaced_prompts(turns: list[dict[str, Any]], prompts: list[dict[str, Any]]) -> list[Any]:
    conversion = with_session_prompts(convert(turns), prompts)
    return [p.content for p in conversion.unplaced if p.legacy_id == "session_hitl"]


def test_an_older_pending_prompt_no_message_holds_is_kept_in_a_problem() -> None:
    """Only the newest pending prompt can be `pending_hitl`; an older one that no message
    raised is content only `session_hitl` holds."""
    raised = {"type": "hitl", "action": "pay", "request_id": "req-new", "prompt": "Pay?"}
    turns = [turn(1), turn(2, [raised])]
    older = {**PROMPT, "request_id": "req-old", "created_at": T0}
    newest = {**PROMPT, "request_id": "req-new", "prompt": "Pay?", "created_at": T0 + timedelta(2)}
    raised_older = {"type": "hitl", "action": "refund", "request_id": "req-old",
                    "prompt": "Refund «o-1»?"}  # fmt: skip

    assert unplaced_prompts(turns, [older, newest]) == [older]
    assert unplaced_prompts([turn(1, [raised_older]), *turns[1:]], [older, newest]) == []


@pytest.mark.parametrize("request_id", [None, "", "x" * 201], ids=["none", "blank", "too long"])
def test_a_pending_prompt_without_a_readable_request_id_is_kept_in_a_problem(
    request_id: Any,
) -> None:
    prompt = {**PROMPT, "request_id": request_id}
    assert unplaced_prompts([turn(1)], [prompt]) == [prompt]


PAY = {"type": "hitl", "action": "pay", "params": {}, "request_id": "req-9", "prompt": "Pay?"}


@pytest.mark.parametrize(
    ("text", "read"),
    [
        (json.dumps({"amount": "«9000 EUR»"}), {"amount": "«9000 EUR»"}),
        ('{"amount": 0.10000000000000001}', {"value": '{"amount": 0.10000000000000001}'}),
        ('{"a": 1, "a": 2}', {"value": '{"a": 1, "a": 2}'}),
        ("«9000 EUR»", {"value": "«9000 EUR»"}),
    ],
    ids=["an object", "a number a float changes", "a key twice", "not JSON"],
)
def test_params_a_pending_prompt_keeps_as_json_text_are_read_as_a_parts_are(
    text: str, read: dict[str, Any]
) -> None:
    """Params the prompt holds win over the message's, whatever their type: JSON text is
    read as a HITL part's is (the object it spells when it reads exactly, else the text
    under `value`), never replaced by the message's `{}`."""
    messages = convert([turn(1, [PAY])]).messages
    pending, _ = pending_from_session_hitl([{**PROMPT, "request_id": "req-9", "params": text}],
                                           messages)  # fmt: skip
    raised = convert([turn(1, [{**PAY, "params": text}])]).messages[-1].hitl_action

    assert pending is not None
    assert raised is not None
    assert pending.params == raised.params == read


def test_a_field_of_a_pending_prompt_no_reader_takes_is_kept_in_a_problem() -> None:
    prompt = {**PROMPT, "request_id": "req-9", "context": "«the user asked to pay»"}
    conversion = with_session_prompts(convert([turn(1, [PAY])]), [prompt])

    assert [(p.kind, p.field, p.placed, p.content) for p in conversion.problems] == [
        ("unread_field", "context", False, "«the user asked to pay»")
    ]


@pytest.mark.parametrize("dual_write", [True, False])
def test_a_resolved_prompt_not_valid_utf8_stops_its_conversation_only_when_it_keeps_the_id(
    dual_write: bool,
) -> None:
    """A prompt the new service resolved gives `resolved_hitl` its request id: holding text
    that is not valid UTF-8 (a lone surrogate, as the migration reads such bytes) it is
    refused as the pending prompt is; one the old service resolved is taken nowhere."""
    resolved = {
        **PROMPT,
        "request_id": "req-\udcc3",
        "status": "resolved",
        "dual_write": dual_write,
    }
    conversion = convert([turn(1, [PAY])])

    if dual_write:
        with pytest.raises(InvalidInput, match="request_id holds bytes that are not valid"):
            with_session_prompts(conversion, [resolved])
        return
    assert with_session_prompts(conversion, [resolved]).conversation is not None


def test_every_field_a_session_prompt_is_written_with_is_read() -> None:
    """The fields `session_hitl` keeps about a prompt (whose, which, its state, when) and
    the prompt's own (`action`, `params`, `prompt` or `content`) are no problem."""
    prompt = {
        "_id": ObjectId(), "conversation_id": CID, "session_id": "s-1", "user_id": "user-1",
        "request_id": "req-9", "action": "pay", "params": {}, "prompt": "Pay?",
        "content": "Pay?", "status": "pending", "resolved": False, "created_at": T0,
        "updated_at": T0,
    }  # fmt: skip
    assert with_session_prompts(convert([turn(1, [PAY])]), [prompt]).problems == []


def test_an_older_pending_prompt_with_params_no_message_holds_is_kept_in_a_problem() -> None:
    """A message holds an older prompt only when it raised it with the same action, params
    and text."""
    newest = {**PROMPT, "request_id": "req-new", "created_at": T0 + timedelta(2)}
    older = {**PROMPT, "request_id": "req-9", "action": "pay", "prompt": "Pay?",
             "params": {"amount": "«9000 EUR»"}, "created_at": T0}  # fmt: skip
    turns = [turn(1, [PAY])]

    assert unplaced_prompts(turns, [older, newest]) == [older]
    assert unplaced_prompts(turns, [{**older, "params": {}}, newest]) == []
    assert unplaced_prompts(turns, [{**older, "action": "refund", "params": {}}, newest]) == [
        {**older, "action": "refund", "params": {}}
    ]


# -- properties ----------------------------------------------------------------------------

TOOLS = ["f", "g"]


@st.composite
def legacy_conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Legacy turns whose every piece of content carries a unique marker `<kN>`."""
    counter = iter(range(10_000))

    def marker(kind: str) -> str:
        return f"<{kind}{next(counter)}>"

    turns = []
    for n in range(draw(st.integers(1, 4))):
        parts: list[Any] = []
        for _ in range(draw(st.integers(0, 6))):
            kind = draw(st.sampled_from(["text", "call", "result", "upload", "hitl", "error", "x"]))
            tool = draw(st.sampled_from(TOOLS))
            if kind == "text":
                parts.append({"type": "text", "content": marker("t")})
            elif kind == "call":
                args: Any = {"m": marker("c")}
                if draw(st.booleans()):
                    args = json.dumps(args)
                parts.append({"type": "tool_call", "tool_name": tool, "args": args})
            elif kind == "result":
                parts.append({"type": "tool_result", "tool_name": tool, "result": marker("r")})
            elif kind == "upload":
                parts.append(
                    {"type": "file_upload", "filename": marker("u"), "file_type": "text/plain",
                     "size": 1}
                )  # fmt: skip
            elif kind == "hitl":
                parts.append({"type": "hitl", "action": "ok", "request_id": marker("h")})
            elif kind == "error":
                parts.append({"type": "error", "message": marker("e")})
            else:
                parts.append({"type": "mystery", "content": marker("x")})
        fields: dict[str, Any] = {
            "created_at": T0 + timedelta(minutes=draw(st.integers(0, 2))),
            "user_message": marker("q") if draw(st.booleans()) else "",
            "is_system": draw(st.booleans()),
        }
        if draw(st.booleans()):
            fields["upload_result"] = {
                "filename": marker("u"),
                "file_type": "text/plain",
                "size": 3,
            }
        turns.append(turn(n, parts, **fields))
    return turns


def markers_in(value: Any) -> list[str]:
    return re.findall(r"<[a-z]\d+>", json.dumps(value, default=str))


def all_markers(turns: list[dict[str, Any]]) -> list[str]:
    return sorted(markers_in([{k: v for k, v in t.items() if k != "_id"} for t in turns]))


def placed_markers(messages: list[AgentMessage], problems: list[Problem]) -> list[str]:
    found = markers_in(
        [m.model_dump(mode="json", exclude={"search_text", "id", "turn_id"}) for m in messages]
    )
    found += markers_in([p.content for p in problems if not p.placed])
    return sorted(found)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(legacy_conversations())
def test_every_part_appears_exactly_once(turns: list[dict[str, Any]]) -> None:
    messages, problems = convert_conversation(turns)
    assert placed_markers(messages, problems) == all_markers(turns)


@settings(max_examples=150, deadline=None)
@given(legacy_conversations())
def test_every_tool_message_follows_its_call(turns: list[dict[str, Any]]) -> None:
    messages, _ = convert_conversation(turns)
    for index, message in enumerate(messages):
        if message.role != "tool":
            continue
        before = messages[:index]
        owner = next(
            i
            for i, m in enumerate(before)
            if any(c.id == message.tool_call_id for c in m.tool_calls or ())
        )
        assert all(m.role == "tool" for m in before[owner + 1 :])
    ids = call_ids(messages)
    assert len(ids) == len(set(ids))


@settings(max_examples=100, deadline=None)
@given(legacy_conversations())
def test_converting_twice_gives_identical_documents(turns: list[dict[str, Any]]) -> None:
    first = convert(turns)
    second = convert(list(turns))
    dump = [m.model_dump(by_alias=True) for m in first.messages]
    assert dump == [m.model_dump(by_alias=True) for m in second.messages]
    assert first.conversation == second.conversation
    assert first.problems == second.problems
    assert [m.seq for m in first.messages] == list(range(len(first.messages)))


@settings(max_examples=100, deadline=None)
@given(legacy_conversations())
def test_messages_written_back_as_legacy_turns_convert_to_the_same_messages(
    turns: list[dict[str, Any]],
) -> None:
    """What the dual write stores is read back by the migration as the same conversation."""
    messages, _ = convert_conversation(turns)
    by_turn: dict[str, list[AgentMessage]] = {}
    for message in messages:
        by_turn.setdefault(message.turn_id or "", []).append(message)
    written = [
        legacy_turn_document(CID, turn_id, group, user_id="user-1", name=None)
        for turn_id, group in by_turn.items()
    ]
    again, problems = convert_conversation(written) if written else ([], [])

    assert problems == []

    def visible(ms: list[AgentMessage]) -> list[Any]:
        """One entry per tool call: runs of call-only messages may merge on the way back."""
        ignored = {"id", "turn_id", "search_text", "token_usage", "latency_ms", "seq", "tool_calls"}
        return [
            (m.model_dump(exclude=ignored), call) for m in ms for call in (m.tool_calls or [None])
        ]

    assert visible(again) == visible(messages)


def test_a_turn_with_two_identical_uploads_written_back_as_a_legacy_turn_keeps_both() -> None:
    upload = {"type": "file_upload", "filename": "a.txt", "file_type": "text/plain", "size": 3}
    messages, _ = convert_conversation([turn(1, [upload, upload])])
    written = legacy_turn_document(CID, "t-1", messages, user_id="user-1", name=None)
    again, problems = convert_conversation([written])

    assert [m.upload for m in again] == [m.upload for m in messages] != [None]
    assert problems == []


def test_turns_of_two_conversations_are_refused_naming_them() -> None:
    # An id that is not an identifier is no reason to refuse: it gets a derived one
    # (tests/test_legacy_problems.py).
    with pytest.raises(InvalidInput, match="2 conversation ids"):
        convert([turn(1), turn(2) | {"conversation_id": "other"}])


def test_a_call_its_legacy_turn_left_unanswered_is_pending_after_conversion() -> None:
    """As the logger lists it: a later live turn's answer then resolves it."""
    from datetime import UTC, datetime

    answered = {"type": "tool_call", "tool_name": "look", "args": {}, "tool_call_id": "call-ok"}
    result = {"type": "tool_result", "tool_name": "look", "result": "ok", "tool_call_id": "call-ok"}
    held = {"type": "tool_call", "tool_name": "pay", "args": {}, "tool_call_id": "call-held"}
    prompt = {"type": "hitl", "action": "confirm", "params": {}, "request_id": "r-1",
              "prompt": "Pay?"}  # fmt: skip
    turns = [
        {"_id": "t-1", "conversation_id": "conv-pending", "user_id": "u-1",
         "created_at": datetime(2024, 1, 1, tzinfo=UTC), "user_message": "Pay it.",
         "response_parts": [answered, result, held, prompt]},
    ]  # fmt: skip

    conversation = convert(turns).conversation

    assert conversation is not None
    assert [(c.tool_call_id, c.request_id) for c in conversation.pending_calls] == [
        ("call-held", "r-1")
    ]


def test_a_name_holding_control_or_direction_characters_is_stored_plain_and_kept_whole() -> None:
    name = "Invoice \u202efdp.exe\x00"
    conversion = convert([turn(1, name=name)])

    assert conversion.conversation is not None
    assert conversion.conversation.name == "Invoice fdp.exe"
    assert [(p.kind, p.placed, p.field, p.content) for p in conversion.problems] == [
        ("plain_name", True, "name", name)
    ]


def test_a_name_of_control_characters_alone_names_nothing() -> None:
    conversation = convert([turn(1, name="\u202e\x07")]).conversation
    assert conversation is not None
    assert conversation.name_source != "runtime"


def test_a_name_that_shows_nothing_names_nothing_and_is_kept_whole() -> None:
    name = "\u200b\u3164 \u200f"
    conversion = convert([turn(1, name=name)])

    assert conversion.conversation is not None
    assert conversion.conversation.name_source != "runtime"
    assert [(p.kind, p.placed, p.field, p.content) for p in conversion.problems] == [
        ("plain_name", True, "name", name)
    ]


@pytest.mark.parametrize("last", ["   ", "\u200b", "\u3164", "\u202e\x07"])
def test_a_last_name_that_shows_nothing_leaves_the_earlier_name(last: str) -> None:
    """An invisible name, or one of control characters alone, names nothing, as a blank one:
    the last turn whose name shows something names the conversation; one that shows nothing
    is kept whole in a problem."""
    conversion = convert([turn(1, name="Trip to Rome 2024"), turn(2, name=last)])

    assert conversion.conversation is not None
    assert conversion.conversation.name == "Trip to Rome 2024"
    kept = [(p.kind, p.content) for p in conversion.problems]
    assert kept == ([] if not last.strip() else [("plain_name", last)])


def test_an_earlier_name_of_a_renamed_conversation_is_kept_whole_in_a_placed_problem() -> None:
    """MIGRATION.md: every piece of legacy content is in a message, a file or a problem. A
    conversation renamed between turns is stored under its last name; each earlier name it
    went by is kept whole in an `earlier_name` problem (placed), once, on the first turn
    giving it, so the drop never takes it."""
    turns = [
        turn(1, name="Alpha «m1»"),
        turn(2, name="Beta «m4»"),
        turn(3, name="Alpha «m1»"),
        turn(4, name="Gamma"),
        turn(5, name="Gamma"),
    ]
    conversion = convert(turns)

    assert conversion.conversation is not None
    assert conversion.conversation.name == "Gamma"
    assert [(p.kind, p.placed, p.field, p.legacy_id, p.content) for p in conversion.problems] == [
        ("earlier_name", True, "name", f"{1:024x}", "Alpha «m1»"),
        ("earlier_name", True, "name", f"{2:024x}", "Beta «m4»"),
    ]


def test_every_name_that_shows_nothing_or_holds_control_characters_is_kept_whole() -> None:
    """An earlier name holding a direction character is kept whole (`earlier_name`), and every
    name showing nothing gets its `plain_name` problem, not only the last one."""
    shown = "Trip \u202eto Paris"
    turns = [
        turn(1, name=shown),
        turn(2, name="Plain"),
        turn(3, name="\u200b\x00\u200b"),
        turn(4, name="\u200b"),
    ]
    conversion = convert(turns)

    assert conversion.conversation is not None
    assert conversion.conversation.name == "Plain"
    assert [(p.kind, p.placed, p.field, p.content) for p in conversion.problems] == [
        ("earlier_name", True, "name", shown),
        ("plain_name", True, "name", "\u200b\x00\u200b"),
        ("plain_name", True, "name", "\u200b"),
    ]


def test_a_name_repeated_with_other_white_space_is_one_name() -> None:
    """White space a stored name collapses is no content (`shorten`): a name repeated with
    other spaces is the name the conversation holds, no earlier one."""
    conversion = convert([turn(1, name="Trip  to Rome"), turn(2, name=" Trip to Rome ")])

    assert conversion.conversation is not None
    assert conversion.conversation.name == "Trip to Rome"
    assert conversion.problems == []


@pytest.mark.parametrize(
    ("names", "kept"),
    [
        pytest.param(["Trip\nPlan"], [("plain_name", "Trip\nPlan")], id="alone"),
        pytest.param(["Trip\nPlan", "Trip\nPlan"], [("plain_name", "Trip\nPlan")], id="twice"),
        pytest.param(["Trip\nPlan", "Trip Plan"], [("earlier_name", "Trip\nPlan")], id="then"),
        pytest.param(
            ["Trip\nPlan", "Trip\tPlan"],
            [("earlier_name", "Trip\nPlan"), ("plain_name", "Trip\tPlan")],
            id="then-a-tab",
        ),
    ],
)
def test_a_name_holding_a_tab_or_line_break_is_stored_spaced_and_kept_whole(
    names: list[str], kept: list[tuple[str, str]]
) -> None:
    """A stored name holds spaces alone: a tab or a line break in a legacy name becomes one,
    and the name as found is kept whole (`plain_name` for the name the conversation holds,
    `earlier_name` for one before it), as a control character is: nothing is lost
    silently. Names differing in spaces alone stay one (the test above)."""
    conversion = convert([turn(n + 1, name=name) for n, name in enumerate(names)])

    assert conversion.conversation is not None
    assert conversion.conversation.name == "Trip Plan"
    assert [(p.kind, p.content) for p in conversion.problems if p.placed] == kept
    assert all(p.field == "name" for p in conversion.problems)


def test_a_conversation_of_names_and_no_message_keeps_each_earlier_name_too() -> None:
    turns = [{"_id": f"n-{n}", "conversation_id": CID, "name": name,
              "created_at": T0 + timedelta(minutes=n)}
             for n, name in enumerate(["Tax return «m1»", "Taxes 2024"])]  # fmt: skip
    conversion = convert(turns)

    assert conversion.conversation is None
    assert [(p.kind, p.placed, p.content) for p in conversion.problems] == [
        ("earlier_name", True, "Tax return «m1»"),
        ("name_without_messages", False, "Taxes 2024"),
    ]


ALIKE = ObjectId("65f000000000000000000001")
IDS_READING_ALIKE = {
    "an ObjectId and its text": (ALIKE, str(ALIKE)),
    "a number and its text": (42, "42"),
    "a text and an ObjectId": (str(ALIKE), ALIKE),
}


@pytest.mark.parametrize(
    ("first", "second"), IDS_READING_ALIKE.values(), ids=list(IDS_READING_ALIKE)
)
def test_turns_whose_ids_read_alike_in_one_conversation_get_messages_of_their_own(
    first: Any, second: Any
) -> None:
    """`ObjectId(X)` and `"X"` (a re-import) are two turns: each gets message, call and
    request ids of its own, and the first keeps the ids it gets alone (an earlier run's)."""
    call = {"type": "tool_call", "tool_name": "look", "args": {}}
    prompt = {"type": "hitl", "action": "pay", "params": {}, "prompt": "Pay?"}
    turns = [
        turn(1, [call, {"type": "text", "content": "one"}], _id=first),
        turn(2, [call, prompt], _id=second, user_message="question 2"),
    ]

    alone = convert(turns[:1])
    both = convert(turns)

    assert both.problems == []
    assert [m.content for m in both.messages if m.role == "user"] == ["question 1", "question 2"]
    assert len({m.id for m in both.messages}) == len(both.messages) == 6
    assert len(set(call_ids(both.messages))) == 2
    assert both.messages[: len(alone.messages)] == alone.messages
    assert len({m.turn_id for m in both.messages}) == 2


def test_problems_of_turns_whose_ids_read_alike_name_each_turn_apart() -> None:
    """What one turn could not place is left out of its own transcript only, never out of
    the other turn's (both parts are at index 0)."""
    turns = [
        turn(1, [{"type": "mystery", "content": "kept in a problem"}], _id=ALIKE),
        turn(2, [{"type": "text", "content": "an answer"}], _id=str(ALIKE)),
    ]

    conversion = convert(turns)

    assert [(p.kind, p.legacy_id) for p in conversion.problems] == [("unknown_part", str(ALIKE))]
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []
    assert "assistant: an answer" in legacy.lines


SCOPED = Code("function(){ return x }", {"x": "SCOPE-MARK-42"})
SCOPED_JSON = {"$code": "function(){ return x }", "$scope": {"x": "SCOPE-MARK-42"}}


def test_javascript_code_with_a_scope_is_kept_whole_as_its_extended_json() -> None:
    """BSON code with a scope is a `str` to Python, its code alone: made text as its extended
    JSON (`$code` and `$scope`), as an id stored so is named, wherever it stands (a call's
    arguments, a result, a text part, a user's message)."""
    parts = [
        {"type": "tool_call", "tool_name": "eval", "args": {"src": SCOPED}, "tool_call_id": "c1"},
        {"type": "tool_result", "tool_name": "eval", "result": SCOPED, "tool_call_id": "c1"},
        {"type": "text", "content": SCOPED},
    ]
    turns = [turn(1, parts, user_message=SCOPED)]
    conversion = convert(turns)
    user, call, result, text = conversion.messages

    assert json.loads(str(user.content)) == SCOPED_JSON
    assert call.tool_calls is not None
    held = json.loads(call.tool_calls[0].function.arguments)["src"]  # a value within JSON:
    assert json.loads(held) == SCOPED_JSON  # the text of its extended JSON, as in params
    assert json.loads(str(result.content)) == SCOPED_JSON
    assert json.loads(str(text.content)) == SCOPED_JSON
    legacy = from_legacy(parse_turns(turns), conversion.unplaced)
    assert differences(legacy, from_messages(conversion.messages)) == []


def test_javascript_code_with_a_scope_in_prompt_params_is_kept_as_its_extended_json() -> None:
    """Params hold plain JSON: such code in them is the text of its extended JSON."""
    part = {"type": "hitl", "action": "run", "request_id": "r1", "prompt": "Run it?",
            "params": {"src": SCOPED}}  # fmt: skip
    conversion = convert([turn(1, [part])])
    prompt = conversion.messages[1]

    assert prompt.hitl_action is not None
    assert json.loads(prompt.hitl_action.params["src"]) == SCOPED_JSON


def test_javascript_code_without_a_scope_is_its_code_text() -> None:
    conversion = convert([turn(1, [{"type": "text", "content": Code("return 1")}])])
    assert conversion.messages[1].content == "return 1"


def test_javascript_code_naming_a_tool_or_holding_its_arguments_is_their_text() -> None:
    """Code without a scope holds nothing but its text, wherever it stands: a tool's name
    or a call's arguments too (the conversion once raised TypeError on them, stopping the
    whole migration)."""
    parts = [
        {"type": "tool_call", "tool_name": Code("search"), "args": Code('{"q": "x"}'),
         "tool_call_id": "k1"},
        {"type": "tool_result", "tool_name": "search", "result": "found", "tool_call_id": "k1"},
    ]  # fmt: skip
    conversion = convert([turn(1, parts)])
    call, result = conversion.messages[1:]

    assert call.tool_calls is not None
    assert (call.tool_calls[0].function.name, call.tool_calls[0].function.arguments) == (
        "search",
        '{"q": "x"}',
    )
    assert (result.tool_call_id, result.content) == (call.tool_calls[0].id, "found")
    assert conversion.problems == []


def scoped(tag: str) -> Code:
    return Code("return x", {"x": f"SCOPE-{tag}"})


SCOPED_PLACES: dict[str, dict[str, Any]] = {
    "a prompt's params, whole": {
        "response_parts": [{"type": "hitl", "action": "a", "request_id": "r", "prompt": "p",
                            "params": scoped("params")}]},
    "a prompt's action": {
        "response_parts": [{"type": "hitl", "action": scoped("action"), "request_id": "r",
                            "prompt": "p"}]},
    "an upload's parsed text": {
        "upload_result": {"filename": "a", "file_type": "txt", "size": 1,
                          "parsed_text": scoped("parsed")}},
    "an upload's file name": {
        "upload_result": {"filename": scoped("filename"), "file_type": "txt", "size": 1}},
    "a file upload part's parsed text": {
        "response_parts": [{"type": "file_upload", "filename": "f", "file_type": "t", "size": 1,
                            "parsed_text": scoped("part")}]},
    "the turn's name": {"name": scoped("name")},
}  # fmt: skip


@pytest.mark.parametrize("place", SCOPED_PLACES)
def test_javascript_code_with_a_scope_keeps_its_scope_wherever_it_stands(place: str) -> None:
    """Every value of a legacy turn is read with its code made text before any field is:
    code with a scope as its extended JSON, so no place keeps the code and drops the scope."""
    conversion = convert([turn(1, **SCOPED_PLACES[place])])
    kept = [m.model_dump_json() for m in conversion.messages]
    kept += [conversion.conversation.model_dump_json()] if conversion.conversation else []
    kept += [json.dumps(p.content, default=str) for p in conversion.problems]
    assert any("SCOPE-" in text for text in kept), place


@pytest.mark.parametrize("field", ["action", "prompt", "params"])
def test_javascript_code_with_a_scope_in_a_session_prompt_keeps_its_scope(field: str) -> None:
    prompt = {**PROMPT, "request_id": "req-9", field: scoped(field)}
    conversion = with_session_prompts(convert([turn(1, [PAY])]), [prompt])
    assert conversion.conversation is not None
    kept = [conversion.conversation.model_dump_json()]
    kept += [json.dumps(p.content, default=str) for p in conversion.problems]
    assert any("SCOPE-" in text for text in kept), field
