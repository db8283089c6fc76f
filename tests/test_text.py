"""Text rules: hidden context, previews, names, search text and size bounds."""

from __future__ import annotations

import pytest

from agent_store.store import (
    RuntimeContextMarkers,
    bound_message,
    document_size,
    parse_messages,
    plan_turn,
    shorten,
    strip_runtime_context,
)


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        pytest.param("[RUNTIME CONTEXT]tz=UTC[/RUNTIME CONTEXT]Hello", "Hello", id="prefix"),
        pytest.param(
            "Hi [RUNTIME CONTEXT]a[/RUNTIME CONTEXT] there [RUNTIME CONTEXT]b[/RUNTIME CONTEXT]",
            "Hi  there",
            id="several",
        ),
        pytest.param(
            "[RUNTIME CONTEXT]\nmulti\nline\n[/RUNTIME CONTEXT]\nQ?", "Q?", id="multiline"
        ),
        pytest.param(
            "Question [RUNTIME CONTEXT]never closed secret",
            "Question",
            id="unclosed-hides-the-rest",
        ),
        pytest.param("No context here", "No context here", id="none"),
    ],
)
def test_hidden_runtime_context_is_stripped(raw: str, shown: str) -> None:
    assert strip_runtime_context(raw) == shown


def test_runtime_context_markers_are_configurable() -> None:
    markers = RuntimeContextMarkers("<ctx>", "</ctx>")
    assert strip_runtime_context("<ctx>secret</ctx>visible", markers) == "visible"


def test_shorten_cuts_at_a_word_boundary_with_an_ellipsis() -> None:
    assert shorten("one two three four", 12) == "one two…"
    assert shorten("  spaced\n\tout  ", 60) == "spaced out"
    assert shorten("x" * 100, 10) == "x" * 9 + "…"


def test_a_plan_counts_turn_starts_usage_and_preview() -> None:
    plan = plan_turn(
        "c",
        [
            {"role": "system", "content": "trigger"},
            {"role": "user", "content": "question"},
            {
                "role": "assistant",
                "content": "answer " * 100,
                "token_usage": {"input_tokens": 3, "output_tokens": 4},
            },
        ],
    )
    assert plan.turn_starts == 1
    assert (plan.usage.input_tokens, plan.usage.output_tokens) == (3, 4)
    assert plan.preview is not None
    assert plan.preview.endswith("…")
    assert len(plan.preview) <= 200


def test_message_ids_are_stable_for_a_turn() -> None:
    raw = [{"role": "user", "content": "hi", "created_at": "2026-01-01T00:00:00Z"}]
    assert [m.id for m in plan_turn("c", raw).messages] == [
        m.id for m in plan_turn("c", raw).messages
    ]
    assert plan_turn("c", raw).turn_id != plan_turn("d", raw).turn_id


def test_a_message_over_the_bound_keeps_the_start_of_its_text_and_says_so() -> None:
    message = parse_messages([{"role": "tool", "tool_call_id": "c", "content": "abc" * 1_000_000}])[
        0
    ]
    bounded = bound_message(message, max_bytes=64 * 1024)
    assert document_size(bounded.model_dump(by_alias=True)) <= 64 * 1024
    assert bounded.truncated == {"content": 3_000_000}
    assert bounded.content is not None
    assert bounded.content.startswith("abcabc")


def test_cut_tool_arguments_stay_a_json_string() -> None:
    import json

    message = parse_messages(
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "function": {"name": "f", "arguments": {"blob": "x" * 200_000}}}
                ],
            }
        ]
    )[0]
    bounded = bound_message(message, max_bytes=16 * 1024)
    assert bounded.tool_calls is not None
    assert "truncated_arguments" in json.loads(bounded.tool_calls[0].function.arguments)
    assert bounded.truncated is not None
    assert "tool_calls.0.function.arguments" in bounded.truncated


@pytest.mark.parametrize(
    ("query", "positive"),
    [
        ("paris", True),
        ("paris -lyon", True),
        ("- paris", True),
        ('"-in paris"', True),
        ("été", True),
        ("-a -b", False),
        ("-", False),
        ("!!! ???", False),
        ('-"in paris"', False),
        ("--a", False),
        ('""', False),
    ],
)
def test_a_search_needs_a_word_that_is_not_excluded(query: str, positive: bool) -> None:
    from agent_store.store._text import has_positive_term

    assert has_positive_term(query) is positive
