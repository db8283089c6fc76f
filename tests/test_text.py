"""Text rules: hidden context, previews, names, search text and size bounds."""

from __future__ import annotations

import hashlib
import random
import unicodedata

import pytest

from agent_store import InvalidInput, Truncation
from agent_store.core import message_adapter
from agent_store.store import (
    TRUNCATION_MARK,
    RuntimeContextMarkers,
    blob_id,
    bound,
    bound_message,
    document_size,
    parse_messages,
    plan_turn,
    prompt_text,
    shorten,
    split_runtime_context,
    strip_runtime_context,
    strip_runtime_context_pieces,
    without_runtime_context,
)
from agent_store.store._text import HIDDEN_CHARACTERS, message_text, search_text, shows_nothing


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


RC, END = "[RUNTIME CONTEXT]", "[/RUNTIME CONTEXT]"


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        pytest.param(f"{RC}outer {RC}inner S1{END} S2{END}visible", "visible", id="nested-block"),
        pytest.param(f"{RC}a {RC}b {RC}c{END}{END}{END} Hi", "Hi", id="three-deep"),
        pytest.param(
            f"{RC}a{END} kept {RC}b {RC}c{END} S2{END} also kept", "kept  also kept", id="siblings"
        ),
        pytest.param(f"Q {RC}outer {RC}inner{END} never closed S", "Q", id="nested-unclosed"),
        pytest.param(
            f"S1 of a block whose start was cut off{END}visible", "visible", id="stray-end-hides"
        ),
    ],
)
def test_hidden_context_is_removed_through_its_matching_end_marker(raw: str, shown: str) -> None:
    assert strip_runtime_context(raw) == shown


@pytest.mark.parametrize(
    ("pieces", "shown"),
    [
        pytest.param(["[RUNTIME CON", f"TEXT]S1{END}", "Hi"], ["", "", "Hi"], id="start-split"),
        pytest.param([f"{RC}S1[/RUNTIME", " CONTEXT]Hi"], ["", "Hi"], id="end-split"),
        pytest.param([f"{RC}S1", f"S2{END}Hi", "there"], ["", "Hi", "there"], id="block-spans"),
        pytest.param([" Hi ", "there"], [" Hi ", "there"], id="untouched"),
    ],
)
def test_pieces_are_stripped_as_one_text_whatever_the_cut(
    pieces: list[str], shown: list[str]
) -> None:
    assert strip_runtime_context_pieces(pieces) == shown


@pytest.mark.parametrize(
    ("raw", "hidden"),
    [
        pytest.param(f"{RC}tz=UTC{END} Hello", f"{RC}tz=UTC{END}", id="prefix"),
        pytest.param(f"Hi {RC}a{END} there {RC}b{END}", f"{RC}a{END}{RC}b{END}", id="several"),
        pytest.param(f"{RC}a {RC}b{END} c{END} Hi", f"{RC}a {RC}b{END} c{END}", id="nested"),
        pytest.param(f"Q {RC}never closed", f"{RC}never closed", id="unclosed"),
        pytest.param(f"cut off{END} visible", f"cut off{END}", id="stray-end"),
        pytest.param("No context here", "", id="none"),
    ],
)
def test_what_is_stripped_is_every_hidden_piece_as_written(raw: str, hidden: str) -> None:
    """`split_runtime_context` gives what the user saw, as `strip_runtime_context` does, and
    the rest of the text, markers included: the migration keeps that in a problem."""
    assert split_runtime_context(raw) == (strip_runtime_context(raw), hidden)


def test_runtime_context_markers_are_configurable() -> None:
    markers = RuntimeContextMarkers("<ctx>", "</ctx>")
    assert strip_runtime_context("<ctx>secret</ctx>visible", markers) == "visible"


@pytest.mark.parametrize(
    "blank", ["", " ", "\t", "\n \u00a0"], ids=["empty", "space", "tab", "mixed"]
)
def test_runtime_context_markers_of_white_space_alone_are_refused(blank: str) -> None:
    """Such a marker matches between the user's words: a message would be stored cut at its
    first space (a start) or keep only what follows its last (an end)."""
    for start, end in ((blank, "</ctx>"), ("<ctx>", blank)):
        with pytest.raises(ValueError, match="white space"):
            RuntimeContextMarkers(start, end)


@pytest.mark.parametrize(
    ("start", "end"),
    [("<ctx>", "<ctx>"), ("[CTX]", "[/CTX]x[CTX]"), ("<<ctx>>", "ctx")],
    ids=["equal", "start-inside-end", "end-inside-start"],
)
def test_runtime_context_markers_the_text_cannot_tell_apart_are_refused(
    start: str, end: str
) -> None:
    """A start marker equal to the end, or either holding the other, is read as the other in
    the text: every block would be taken for a lone end marker, hiding the user's words before
    it, or never end, hiding those after it."""
    with pytest.raises(ValueError, match="tell them apart"):
        RuntimeContextMarkers(start, end)


def test_runtime_context_markers_may_have_white_space_around_their_text() -> None:
    markers = RuntimeContextMarkers("<<CONTEXT\n", "\nCONTEXT>>")
    assert strip_runtime_context("<<CONTEXT\ntz=UTC\nCONTEXT>>Plan my trip", markers) == (
        "Plan my trip"
    )


def test_shorten_cuts_at_a_word_boundary_with_an_ellipsis() -> None:
    assert shorten("one two three four", 12) == "one two…"
    assert shorten("  spaced\n\tout  ", 60) == "spaced out"
    assert shorten("x" * 100, 10) == "x" * 9 + "…"


def _shortened_whole(text: str, limit: int) -> str:
    """`shorten` as it reads: the whole text cleaned, then cut."""
    text = " ".join("".join(c for c in text if c not in HIDDEN_CHARACTERS).split())
    if len(text) <= limit:
        return text
    cut = text[: max(limit - 1, 1)]
    if " " in cut and not text[len(cut)].isspace():
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip() + "…"


def test_a_long_text_is_shortened_as_its_whole_text_would_be() -> None:
    pieces = ["word", "a", " ", "  \n\t ", "\u202e", "\x00", "\x1f", "é", "长", " " * 300, "x" * 70]
    rng = random.Random(7)
    for limit in (1, 2, 12, 60, 200):
        for _ in range(300):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 400)))
            assert shorten(text, limit) == _shortened_whole(text, limit), (text, limit)


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
    # Without a message id there is no file to name: the length alone is recorded.
    assert bounded.truncated == {"content": Truncation(length=3_000_000)}
    assert bounded.content is not None
    assert bounded.content.startswith("abcabc")


def test_a_cut_message_with_an_id_hands_over_its_whole_text_under_a_derived_blob_id() -> None:
    message = parse_messages(
        [{"_id": "m-1", "role": "tool", "tool_call_id": "c", "content": "abc" * 1_000_000}]
    )[0]
    bounded = bound(message, max_bytes=64 * 1024)
    [full] = bounded.full_texts
    assert (full.message_id, full.path, full.text) == ("m-1", "content", "abc" * 1_000_000)
    assert full.blob_id == blob_id("m-1", "content")
    assert bounded.message.truncated == {
        "content": Truncation(
            length=3_000_000,
            blob_id=full.blob_id,
            sha256=hashlib.sha256(("abc" * 1_000_000).encode()).hexdigest(),
        )
    }


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


def test_a_message_just_over_its_bound_keeps_most_of_its_text_visible_and_searchable() -> None:
    """A 7.6 kB question under a 4 kB bound once kept none of its content."""
    text = "word " * 1520
    (message,) = plan_turn("c", [{"role": "user", "content": text}], turn_id="t").messages
    bounded = bound_message(message, max_bytes=4096)
    assert document_size(bounded.model_dump(by_alias=True)) <= 4096
    assert bounded.content is not None
    assert bounded.search_text is not None
    shown = bounded.content.removesuffix(TRUNCATION_MARK)
    assert len(shown) > 4096 // 3, "the bound is shared by the text and its search copy"
    assert text.startswith(shown)
    assert bounded.search_text.removesuffix(TRUNCATION_MARK) == shown  # the same words


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param({"quote": '"' * 100_000}, id="escaped-twice-as-long"),
        pytest.param({"control": "\x01" * 30_000}, id="escaped-six-times-as-long"),
        pytest.param({"a": "x" * 9_000, "b": "é" * 9_000}, id="two-byte-characters"),
    ],
)
def test_a_cut_message_fits_its_bound_whatever_its_text_escapes_to(
    arguments: dict[str, str],
) -> None:
    (message,) = parse_messages(
        [
            {
                "role": "assistant",
                "content": "Calling the tool." * 500,
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}],
            }
        ]
    )
    bounded = bound_message(message, max_bytes=16 * 1024)
    assert document_size(bounded.model_dump(by_alias=True)) <= 16 * 1024
    assert bounded.truncated is not None
    assert {"content", "tool_calls.0.function.arguments"} <= set(bounded.truncated)


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
    from agent_store.store._text import search_words

    assert search_words(query)[0] is positive


def test_every_format_character_shows_nothing() -> None:
    """`INVISIBLE_RANGES` holds Unicode's category Cf as this Python reads it."""
    formats = [chr(c) for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf"]
    assert [f"U+{ord(c):04X}" for c in formats if not shows_nothing(c)] == []
    assert not shows_nothing("\u200ba\u200b")


# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt, Unicode 15.1), which
# Python's unicodedata does not expose: reserved code points among them show nothing either.
DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
    (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F), (0x3164, 0x3164),
    (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)  # fmt: skip


def test_every_default_ignorable_code_point_shows_nothing() -> None:
    ignorable = [chr(c) for first, last in DEFAULT_IGNORABLE for c in range(first, last + 1)]
    assert [f"U+{ord(c):04X}" for c in ignorable if not shows_nothing(c)] == []


def test_a_user_message_holding_no_marker_is_stored_as_it_is_without_a_copy() -> None:
    """The turn's hot path: every text of a user message is looked at, none copied."""
    (message,) = parse_messages([{
        "role": "user", "content": "see [file]", "error": {"message": "oops"},
        "upload": {"filename": "a.txt", "file_type": "text/plain", "size": 3, "parsed_text": "x"},
        "native": {"format": "openai-agents", "set": {"content": [{"text": "[RUNTIME", "t": 1}]}},
    }])  # fmt: skip

    assert without_runtime_context(message) is message


def test_a_user_messages_text_that_was_only_context_and_must_not_be_empty_is_refused() -> None:
    """A `native` format that held nothing but hidden context is empty once it is removed:
    refused, saying where, rather than stored as no message could be read back."""
    turn = [{"role": "user", "content": "hi", "native": {"format": f"{RC}x{END}", "set": {}}}]

    with pytest.raises(InvalidInput, match=r"runtime context removed.*native\.format"):
        plan_turn("c-1", turn)


@pytest.mark.parametrize(
    ("content", "given", "shown"),
    [
        (None, "[uploaded invoice.pdf (application/pdf)]", "invoice.pdf"),
        ("", "[uploaded invoice.pdf (application/pdf)]", "invoice.pdf"),  # was only context
        ("Pay this", "Pay this", "Pay this"),
    ],
)
def test_an_upload_with_no_text_stands_for_the_message_to_a_model_and_in_previews(
    content: str | None, given: str, shown: str
) -> None:
    """No text, or none left once hidden context is removed, is the same: the file note goes
    to a model (`prompt_text`: every replay), its name to previews, and search finds it."""
    upload = {"filename": "invoice.pdf", "file_type": "application/pdf", "size": 10}
    said = message_adapter.validate_python({"role": "user", "content": content, "upload": upload})

    assert prompt_text(said) == given
    assert message_text(said) == shown
    assert "invoice.pdf" in (search_text(said) or "")
