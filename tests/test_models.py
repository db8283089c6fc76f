"""The message contract: what each role may carry, and how values are normalized."""

from __future__ import annotations

import contextlib
import gc
import json
import re
import time
from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from bson import DBRef
from pydantic import TypeAdapter, ValidationError

from agent_store.core import (
    MAX_TOOL_CALLS,
    AssistantMessage,
    Identifier,
    InvalidInput,
    NativeForm,
    message_adapter,
)
from agent_store.store import parse_messages, validate_identifier
from agent_store.store._reservation import recorded_block
from agent_store.store._turns import Gaps


def parse(raw: dict[str, Any]) -> Any:
    return parse_messages([raw])[0]


def test_a_dict_of_arguments_is_stored_as_a_json_string() -> None:
    message = parse(
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": {"a": [1, "é"]}}}],
        }
    )
    arguments = message.tool_calls[0].function.arguments
    assert isinstance(arguments, str)
    assert json.loads(arguments) == {"a": [1, "é"]}


@pytest.mark.parametrize(
    ("number", "spelt"),
    [(float("nan"), "NaN"), (float("inf"), "Infinity"), (float("-inf"), "-Infinity")],
    ids=["nan", "infinity", "minus-infinity"],
)
def test_a_dict_of_arguments_holding_nan_or_an_infinity_is_kept_as_pythons_json_writes_it(
    number: float, spelt: str
) -> None:
    """As a model's argument string holding them is kept: a parser's dict of it is no less."""
    call = {"id": "c1", "function": {"name": "f", "arguments": {"rate": [number]}}}
    message = parse({"role": "assistant", "tool_calls": [call]})

    assert message.tool_calls[0].function.arguments == f'{{"rate":[{spelt}]}}'


def test_a_model_string_that_is_not_json_is_kept_as_it_came() -> None:
    message = parse(
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{oops"}}],
        }
    )
    assert message.tool_calls[0].function.arguments == "{oops"


def test_datetimes_become_aware_utc_at_millisecond_precision() -> None:
    paris = timezone(timedelta(hours=1))
    message = parse(
        {
            "role": "user",
            "content": "hi",
            "created_at": datetime(2026, 1, 1, 10, 0, 0, 123456, paris),
        }
    )
    assert message.created_at == datetime(2026, 1, 1, 9, 0, 0, 123000, UTC)
    naive = parse({"role": "user", "content": "hi", "created_at": datetime(2026, 1, 1, 9)})
    assert naive.created_at.tzinfo is UTC


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        pytest.param(
            {"role": "tool", "content": "x"},
            "a tool message needs `tool_call_id`",
            id="tool-needs-call-id",
        ),
        pytest.param(
            {"role": "user", "content": "x", "tool_call_id": "c"},
            "`tool_call_id` is not allowed on a user message",
            id="call-id-on-user",
        ),
        pytest.param(
            {"role": "system", "content": "x", "token_usage": {}},
            "`token_usage` is not allowed on a system message",
            id="usage-on-system",
        ),
        pytest.param(
            {"role": "tool", "tool_call_id": "c", "content": "x", "token_usage": {}},
            "`token_usage` is not allowed on a tool message",
            id="usage-on-tool",
        ),
        pytest.param(
            {"role": "user"}, "a user message needs `content` or an `upload`", id="empty-user"
        ),
        pytest.param(
            {"role": "assistant"},
            "an assistant message needs `content`, `tool_calls`",
            id="empty-assistant",
        ),
        pytest.param(
            {"role": "assistant", "tool_calls": []},
            "`tool_calls` must be null or hold at least one call",
            id="no-calls",
        ),
        pytest.param(
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "function": {"name": "f"}},
                    {"id": "c", "function": {"name": "f"}},
                ],
            },
            "tool call ids repeat within one message: 'c'",
            id="repeated-ids",
        ),
        pytest.param(
            {
                "role": "assistant",
                "hitl_action": {
                    "action": "a",
                    "request_id": "r",
                    "tool_call_ids": [f"c{n}" for n in range(101)],
                },
            },
            "tool_call_ids: List should have at most 100 items",
            id="prompt-naming-too-many-calls",
        ),
        pytest.param(
            {
                "role": "assistant",
                "hitl_action": {"action": "a", "request_id": "r", "tool_call_ids": [""]},
            },
            "tool_call_ids.0: String should have at least 1 character",
            id="prompt-naming-an-empty-id",
        ),
        pytest.param(
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f" * 257}}]},
            "String should have at most 256 characters",
            id="tool-name-too-long",
        ),
        pytest.param(
            {"role": "assistant", "hitl_action": {"action": "a" * 257, "request_id": "r"}},
            "hitl_action.action: String should have at most 256 characters",
            id="prompt-action-too-long",
        ),
        pytest.param(
            {"role": "user", "upload": {"filename": "f" * 1025, "file_type": "t", "size": 1}},
            "upload.filename: String should have at most 1024 characters",
            id="upload-filename-too-long",
        ),
        pytest.param(
            {"role": "user", "upload": {"filename": "f", "file_type": "t" * 256, "size": 1}},
            "upload.file_type: String should have at most 255 characters",
            id="upload-type-too-long",
        ),
        pytest.param(
            {"role": "user", "content": "x", "seq": -1},
            "seq: Input should be greater than or equal to 0",
            id="negative-seq",
        ),
        pytest.param(
            {"role": "user", "content": "x", "surprise": 1},
            "surprise: Extra inputs are not permitted",
            id="unknown-field",
        ),
        pytest.param(
            {"role": "user", "content": "x", "_id": "$where"},
            "_id: an id is 1-200 characters of",
            id="operator-id",
        ),
    ],
)
def test_messages_breaking_the_contract_are_refused_with_the_reason(
    raw: dict[str, Any], error: str
) -> None:
    with pytest.raises(InvalidInput, match=re.escape(error)):
        parse(raw)


def test_names_copied_onto_the_conversation_are_taken_up_to_their_bound() -> None:
    """A tool's name and a prompt's action are copied onto the conversation document (its
    pending calls, its pending prompt), never cut: they are bounded instead, so that document
    stays far from MongoDB's 16 MiB whatever a caller sends."""
    call = {"id": "c", "function": {"name": "f" * 256}}
    assert parse({"role": "assistant", "tool_calls": [call]}).tool_calls is not None
    prompt = {"action": "a" * 256, "request_id": "r"}
    assert parse({"role": "assistant", "hitl_action": prompt}).hitl_action is not None
    upload = {"filename": "f" * 1024, "file_type": "t" * 255, "size": 1}
    assert parse({"role": "user", "upload": upload}).upload is not None


def test_every_role_dumps_the_same_keys() -> None:
    keys = {
        frozenset(message_adapter.dump_python(parse(raw), by_alias=True))
        for raw in [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "tool_call_id": "c", "content": "t"},
        ]
    }
    assert len(keys) == 1


def test_a_turns_block_runs_from_its_record_to_the_next_one() -> None:
    at = datetime.now(UTC)
    document = {
        "message_count": 10,
        "turns": [
            {"k": 11, "f": 0, "d": 1, "a": at},
            {"k": 22, "f": 4, "d": 2, "a": at},
            {"k": 33, "f": 9, "d": 3, "a": at},
        ],
    }
    blocks = [recorded_block(document, key) for key in (11, 22, 33)]
    assert [(b.first_seq, b.count, b.digest) for b in blocks if b] == [
        (0, 4, 1),
        (4, 5, 2),
        (9, 1, 3),
    ]
    assert recorded_block(document, 44) is None


def test_a_turns_block_is_its_records_own_extent_whatever_records_were_dropped() -> None:
    """A record says how many `seq`s its turn reserved (`l`): that is its block, whatever
    record follows it in the window. One without (kept before records said so) runs to the
    next record when that one is the next appended (`o` one more), or when either does not
    say its order; with a record between them dropped, to the next kept one still, unless
    the retry sends the record's content (`sent`), which is as many messages as it sends."""
    at = datetime.now(UTC)
    document = {
        "message_count": 12,
        "turns_dropped": 1,
        "turns": [
            {"k": 11, "f": 2, "d": 1, "a": at, "o": 1, "l": 2},
            {"k": 22, "f": 6, "d": 2, "a": at, "o": 3},
            {"k": ~33, "f": 8, "d": 3, "a": at, "o": 4, "m": True},
            {"k": 33, "f": 10, "d": 3, "a": at, "o": 5},
        ],
    }
    blocks = [recorded_block(document, key) for key in (11, 22, ~33, 33)]
    assert [(b.first_seq, b.count) for b in blocks if b] == [(2, 2), (6, 2), (8, 2), (10, 2)]
    document["turns"][0].pop("l")
    unknown = recorded_block(document, 11)
    assert unknown is not None
    assert unknown.count == 4
    sent = SimpleNamespace(count=2, matches=lambda digest: digest == 1)
    same = recorded_block(document, 11, sent=sent)  # type: ignore[arg-type]
    assert same is not None
    assert same.count == 2


def test_the_turn_a_seq_is_in_ends_where_its_record_says_whatever_records_were_dropped() -> None:
    """`Gaps.turn_end` (a fork's and a call lookup's bound on the turn still being written at
    a `seq`): the block's own extent, not the next record kept, when the record says it."""
    at = datetime.now(UTC)
    turns = [
        {"k": 11, "f": 2, "d": 1, "a": at, "o": 1, "l": 2},
        {"k": 22, "f": 6, "d": 2, "a": at, "o": 3, "l": 2},
    ]
    gaps = Gaps.of({"turns": turns})
    assert [gaps.turn_end(seq, 8) for seq in (2, 3, 6)] == [3, 3, 7]
    older = Gaps.of({"turns": [{k: v for k, v in r.items() if k != "l"} for r in turns]})
    assert older.turn_end(2, 8) == 5  # written before records said their extent


def test_assistant_message_is_a_model_too() -> None:
    message = AssistantMessage(content="hello")
    assert message.role == "assistant"


def test_replacing_fields_gives_what_a_model_copy_gives_and_stays_frozen() -> None:
    call = {"id": "c1", "function": {"name": "f"}}
    message = parse({"role": "assistant", "content": "hi", "tool_calls": [call]})
    update = {"seq": 7, "conversation_id": "c-1"}

    replaced, copied = message.replacing(update), message.model_copy(update=update)

    assert replaced == copied
    assert replaced.model_dump() == copied.model_dump()
    assert replaced.model_fields_set == copied.model_fields_set
    assert (message.seq, message.conversation_id) == (None, None)  # the original is untouched
    with pytest.raises(ValueError, match="frozen"):
        replaced.seq = 8


def test_an_error_names_the_first_ten_repeated_call_ids_and_counts_the_rest() -> None:
    calls = [{"id": f"c{n:02}", "function": {"name": "f"}} for n in range(25)] * 2
    with pytest.raises(InvalidInput) as raised:
        parse_messages([{"role": "assistant", "tool_calls": calls}])
    named = ", ".join(repr(f"c{n:02}") for n in range(10))
    assert f"tool call ids repeat within one message: {named} and 15 more" in str(raised.value)


def _validation_seconds(calls: int, *, repeated: bool) -> float:
    """The least CPU time of this thread (not the wall clock: other processes running meanwhile
    are not counted) of five validations of eight assistant messages with `calls` tool calls
    each, of distinct ids, or each id given twice if `repeated` (eight, so that the time
    measured is well above the clock's noise at `MAX_TOOL_CALLS`)."""
    ids = [f"c{n // 2 if repeated else n}" for n in range(calls)]
    message = {
        "role": "assistant",
        "tool_calls": [{"id": i, "function": {"name": "f"}} for i in ids],
    }
    times = []
    gc.collect()
    gc.disable()  # a collection falling in one measure and not the other is noise
    try:
        for _ in range(5):
            started = time.thread_time()
            with contextlib.suppress(InvalidInput):
                parse_messages([message] * 8)
            times.append(time.thread_time() - started)
    finally:
        gc.enable()
    return min(times)


@pytest.mark.parametrize("repeated", [False, True], ids=["distinct-ids", "each-id-twice"])
def test_checking_a_messages_call_ids_grows_with_their_number_not_its_square(
    repeated: bool,
) -> None:
    """Eight times the calls cost about eight times as much (64 times if every call were
    compared with every other): a request of many calls cannot stall the service."""
    # Measured in turns, the least of each kept: a busy machine slows both alike.
    small = large = float("inf")
    for _ in range(3):
        small = min(small, _validation_seconds(MAX_TOOL_CALLS // 8, repeated=repeated))
        large = min(large, _validation_seconds(MAX_TOOL_CALLS, repeated=repeated))
    assert large / small < 24


def _calls(count: int) -> list[dict[str, Any]]:
    return [{"id": f"c{n}", "function": {"name": "f"}} for n in range(count)]


def test_a_message_makes_at_most_max_tool_calls() -> None:
    parse_messages([{"role": "assistant", "tool_calls": _calls(MAX_TOOL_CALLS)}])
    refusal = f"tool_calls: List should have at most {MAX_TOOL_CALLS} items"
    with pytest.raises(InvalidInput, match=refusal):
        parse_messages([{"role": "assistant", "tool_calls": _calls(MAX_TOOL_CALLS + 1)}])


def _hitl(params: dict[str, Any]) -> dict[str, Any]:
    action = {"action": "confirm", "request_id": "r-1", "params": params}
    return {"role": "assistant", "content": "ok?", "hitl_action": action}


def test_params_nested_any_depth_past_the_limit_are_invalid_input() -> None:
    """Refused as 65 levels are, 100,000 too: not a RecursionError."""
    for levels in (65, 100_000):
        inner: list[Any] = []
        params: dict[str, Any] = {"a": inner}
        for _ in range(levels):
            inner.append([])
            inner = inner[0]
        with pytest.raises(InvalidInput, match="nest"):
            parse_messages([_hitl(params)])


@pytest.mark.parametrize(
    "params",
    [{"a": {"b\x00": 1}}, {"a": [{1: "x"}]}],
    ids=["nul-in-a-key", "integer-key"],
)
def test_params_with_a_key_that_is_no_json_key_are_invalid_input(params: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput, match="params"):
        parse_messages([_hitl(params)])


@pytest.mark.parametrize("number", [2**63, -(2**63) - 1, float("inf"), float("nan")])
def test_a_native_value_bson_cannot_hold_as_it_is_is_invalid_input_at_any_depth(
    number: float,
) -> None:
    """Such a value is kept as its JSON text (`NativeForm.keeping`), never as it is."""
    native = {"format": "langchain", "set": {"a": [{"b": [1, number]}]}}
    with pytest.raises(InvalidInput, match=r"native\.set\.a: .*its JSON text"):
        parse_messages([{"role": "assistant", "content": "x", "native": native}])


def test_a_native_value_bson_cannot_hold_as_it_is_is_kept_as_its_json_text() -> None:
    value = {"wei": 10**20, "logprob": float("-inf"), "nan": float("nan"), "s": "é"}
    form = NativeForm.keeping("langchain", {"meta": value, "id": 2**62}, ["name"])

    assert form.json_text == ["meta"]
    assert form.set == {
        "meta": json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        "id": 2**62,
    }
    assert form.unset == ["name"]
    given = form.set_values()
    assert json.dumps(given) == json.dumps({"meta": value, "id": 2**62})
    assert NativeForm.model_validate(form.model_dump()) == form  # as it is stored and read


SCHEMA = {"$id": "https://example.com/city.json", "$ref": "#/$defs/city", "$defs": {}}
"""A JSON Schema that BSON gives back as a database reference (PyMongo: a `bson.DBRef`)."""


@pytest.mark.parametrize(
    "value", [SCHEMA, [{"s": SCHEMA}], {**SCHEMA, "$db": None}], ids=["itself", "nested", "db"]
)
def test_a_native_value_bson_reads_back_as_a_dbref_is_kept_as_its_json_text(value: Any) -> None:
    form = NativeForm.keeping("langchain", {"meta": value})

    assert form.json_text == ["meta"]
    assert form.set_values() == {"meta": value}
    native = {"format": "langchain", "set": {"meta": value}}
    with pytest.raises(InvalidInput, match=r"native\.set\.meta: .*DBRef.*its JSON text"):
        parse_messages([{"role": "assistant", "content": "x", "native": native}])


@pytest.mark.parametrize(
    "value",
    [{"$ref": 1, "$id": 1}, {"$ref": "a"}, {"$ref": "a", "$id": 1, "$db": 5}],
    ids=["ref-no-text", "no-id", "db-no-text"],
)
def test_an_object_bson_gives_back_as_it_is_is_kept_as_it_is(value: dict[str, Any]) -> None:
    assert NativeForm.keeping("langchain", {"meta": value}).set == {"meta": value}


def test_a_stored_dbref_reads_as_the_object_it_was_written_as() -> None:
    """In a native form as its JSON text, as the store keeps one now; in params as it is."""
    ref = DBRef(SCHEMA["$ref"], SCHEMA["$id"], _extra={"$defs": {"c": DBRef("x", 1)}})
    written = {**SCHEMA, "$defs": {"c": {"$ref": "x", "$id": 1}}}
    native = {"format": "langchain", "set": {"meta": [ref], "n": 1}, "json_text": []}
    [message] = parse_messages([{"role": "assistant", "content": "x", "native": native}])
    assert message.native is not None
    assert message.native.json_text == ["meta"]
    assert message.native.set_values() == {"meta": [written], "n": 1}
    params = {"schema": ref}
    [message] = parse_messages([_hitl(params)])
    assert message.hitl_action is not None
    assert message.hitl_action.params == {"schema": written}


@pytest.mark.parametrize("refused", [{"a\x00": 1}, {1: "x"}], ids=["nul-in-a-key", "integer-key"])
def test_a_value_beside_such_a_number_that_is_no_json_is_refused_not_made_text(
    refused: dict[Any, Any],
) -> None:
    """JSON text would keep the NUL, and spell the integer key as text: the value changed."""
    with pytest.raises(ValidationError, match=r"set\.meta"):
        NativeForm.keeping("langchain", {"meta": {"wei": 10**20, "inner": refused}})


@pytest.mark.parametrize(
    ("set", "json_text"),
    [({"a": 1}, ["a"]), ({"a": "not json"}, ["a"]), ({}, ["a"]), ({"a": "[1]"}, ["a", "a"])],
    ids=["not-a-text", "no-json-text", "not-in-set", "twice"],
)
def test_a_key_listed_as_json_text_holds_json_text(
    set: dict[str, Any], json_text: list[str]
) -> None:
    native = {"format": "langchain", "set": set, "json_text": json_text}
    with pytest.raises(InvalidInput, match="json_text"):
        parse_messages([{"role": "assistant", "content": "x", "native": native}])


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        ('{"a\\u0000b":[100000000000000000000]}', "keys must not contain NUL characters"),
        ("[" * 65 + "1e400" + "]" * 65, "values nest deeper than 64 levels"),
        ('{"a":[1,2.5,"x"]}', "holds no number BSON cannot hold as it is"),
        ('[10000000000000000000000000,"\\ud800"]', r"lone UTF-16 surrogate \(\\ud800\)"),
        ('{"\\udfff":1e400}', r"lone UTF-16 surrogate \(\\udfff\)"),
    ],
    ids=["nul-in-a-key", "nested-too-deeply", "no-such-number", "lone-surrogate", "in-a-key"],
)
def test_a_json_text_value_is_what_keeping_would_write(text: str, refusal: str) -> None:
    """What its text spells passes the checks of a value of `set`, but for the numbers BSON
    cannot hold as they are: it holds one, or it would be kept as it is."""
    native = {"format": "langchain", "set": {"a": text}, "json_text": ["a"]}
    with pytest.raises(InvalidInput, match=rf"native: json_text names a, .*{refusal}"):
        parse_messages([{"role": "assistant", "content": "x", "native": native}])


def test_a_json_text_value_escaping_a_surrogate_pair_spells_one_character() -> None:
    native = {"format": "langchain", "set": {"a": '["\\ud83d\\ude00",1e400]'}, "json_text": ["a"]}
    [message] = parse_messages([{"role": "assistant", "content": "x", "native": native}])

    assert message.native is not None
    assert message.native.set_values() == {"a": ["\U0001f600", float("inf")]}


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"s": "\ud800"}, "set.meta.s"),
        ({"l": [1, {"t": "a\udfff"}]}, "set.meta.l.1.t"),
        ({"k": {"\udfff": 1}}, "set.meta.k"),
    ],
    ids=["in-a-value", "nested", "in-a-key"],
)
@pytest.mark.parametrize("number", [None, 10**20, float("nan")], ids=["alone", "wide", "nan"])
def test_a_lone_surrogate_is_refused_by_its_path_with_or_without_such_a_number(
    value: dict[str, Any], where: str, number: float | None
) -> None:
    """Checked as a value of `set` is, before it would be kept as JSON text: the same
    refusal either way, never the `json_text` key named in place of the path."""
    with pytest.raises(ValidationError) as refused:
        NativeForm.keeping("langchain", {"meta": {**value, "n": number}})

    [error] = refused.value.errors()
    assert ".".join(map(str, error["loc"])) == where
    assert "lone UTF-16 surrogate" in error["msg"]


def test_a_surrogate_pair_split_in_a_native_value_is_no_lone_surrogate() -> None:
    form = NativeForm.keeping("langchain", {"meta": {"s": "\ud83d\ude00", "n": 10**20}})

    assert form.json_text == ["meta"]


def _nested(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ([10**20, {"a\x00": 1}], "keys must not contain NUL characters"),
        ([10**20, _nested(64)], "nest deeper than 64"),
        ([10**20, {1: "x"}], "JSON values only"),
        ([10**5000], "too long for JSON text"),
    ],
    ids=["nul-in-a-key", "nested-too-deeply", "integer-key", "too-many-digits"],
)
def test_a_value_beside_such_a_number_is_refused_naming_what_cannot_be_kept(
    value: list[Any], refusal: str
) -> None:
    """The number alone would be kept as JSON text: the refusal names what truly cannot."""
    with pytest.raises(ValidationError, match=r"set\.meta") as refused:
        NativeForm.keeping("langchain", {"meta": {"d": value}})
    assert refusal in str(refused.value)
    assert "outside 64 bits" not in str(refused.value)


DOT_SEGMENTS = [".", ".."]
IDS_WITH_DOTS = ["...", ".a", "..a", "a.", "a..", "a..b", "v1.2", "." + "a" * 199, "a" * 200]


@pytest.mark.parametrize("dots", DOT_SEGMENTS)
def test_a_dot_or_two_dots_alone_is_no_identifier(dots: str) -> None:
    """A URL path reads `.` and `..` (`%2E%2E` too) as the folder itself and its parent: a
    link to `/viewer/conversations/..` leads to `/viewer/`, and clients rewrite
    `/v1/users/..`. Neither is an id: the store and the API refuse them, saying why."""
    with pytest.raises(InvalidInput, match=r"invalid user_id: .*a URL path") as refused:
        validate_identifier(dots, "user_id")
    assert repr(dots) in refused.value.message
    with pytest.raises(ValidationError):
        TypeAdapter(Identifier).validate_python(dots)


@pytest.mark.parametrize("text", [*DOT_SEGMENTS, *IDS_WITH_DOTS, "a" * 201, "a b", "a$", ""])
def test_the_identifier_pattern_and_its_check_agree(text: str) -> None:
    """The pattern the JSON Schemas publish (no look-ahead: pydantic-core's regex has none)
    accepts exactly what the store does."""
    pattern = TypeAdapter(Identifier).json_schema()["pattern"]
    try:
        validate_identifier(text, "id")
    except InvalidInput:
        accepted = False
    else:
        accepted = True
    assert accepted == (text in IDS_WITH_DOTS)
    assert bool(re.fullmatch(pattern.removeprefix("^").removesuffix("$"), text)) == accepted
