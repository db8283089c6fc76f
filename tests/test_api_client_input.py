"""No client input gets a 500, and no error carries the database driver's text.

Each hostile input is answered with a 4xx naming what was wrong, and changes nothing.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
import pytest
from bson import DBRef
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import StringConstraints, TypeAdapter, ValidationError
from pymongo import AsyncMongoClient, monitoring

from agent_store.core import MAX_TOOL_CALLS, UNDESCRIBED_PATTERN, describe_validation_error
from agent_store.store import CONVERSATIONS, MESSAGES, _turns
from app.json_body import MAX_BODY_DEPTH, MAX_BODY_VALUES
from tests.api_harness import (
    OTHER,
    OWNER,
    OWNER_CONVERSATION,
    OWNER_HITL_CONVERSATION,
    Served,
    auth_headers,
    mongomock_db,
    serve,
)
from tests.conftest import Backend

SERVICE = auth_headers()
CONV = f"/v1/conversations/{OWNER_CONVERSATION}"
TURNS = f"{CONV}/turns"
JSON = SERVICE | {"Content-Type": "application/json"}


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db()) as served:
        yield served


async def refused(api: Served, method: str, url: str, content: bytes, status: int) -> str:
    """Send `content` as a JSON body; assert it is refused with `status` and changes nothing."""
    before = await api.digest()
    response = await api.http.request(method, url, content=content, headers=JSON)
    assert response.status_code == status, response.text[:500]
    assert set(response.json()) == {"error"}
    assert await api.digest() == before
    message: str = response.json()["error"]["message"]
    return message


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def turn_with_params(params_json: str) -> bytes:
    hitl = f'{{"action": "confirm", "request_id": "r-1", "params": {params_json}}}'
    message = f'{{"role": "assistant", "content": "ok?", "hitl_action": {hitl}}}'
    return f'{{"turn_id": "t-hostile", "messages": [{message}]}}'.encode()


# -- duplicate keys --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "url", "body", "key"),
    [
        pytest.param(
            "POST", TURNS,
            b'{"turn_id": "t-a", "turn_id": "t-b", "messages": [{"role": "user", "content": "x"}]}',
            "turn_id", id="turn-id",
        ),
        pytest.param(
            "POST", TURNS,
            b'{"messages": [{"role": "user", "content": "x", "role": "assistant"}]}',
            "role", id="a-message-role",
        ),
        pytest.param(
            "POST", TURNS, turn_with_params('{"amount": 1, "amount": 1000000}'),
            "amount", id="a-prompt-param",
        ),
        pytest.param("PATCH", CONV, b'{"name": "a", "name": "b"}', "name", id="patch-name"),
    ],
)  # fmt: skip
async def test_a_body_naming_a_key_twice_in_one_object_is_refused_with_400(
    api: Served, method: str, url: str, body: bytes, key: str
) -> None:
    """Which of two values a reader takes differs from reader to reader (this service's
    parser, a proxy's, an audit log's): the body is refused, nothing written."""
    message = await refused(api, method, url, body, 400)
    assert f"names the key {key} twice in one object" in message


async def test_a_key_named_twice_that_is_no_plain_name_is_shown_as_key(api: Served) -> None:
    """SECURITY.md: an error never repeats raw input; a body key that is not a plain name is
    shown as `<key>`, as everywhere else."""
    key = "<script>alert(1)</script>"
    body = json.dumps({"name": "a", "k": 1}).replace('"k": 1', f'"{key}": 1, "{key}": 2')
    message = await refused(api, "PATCH", CONV, body.encode(), 400)
    assert "names the key <key> twice in one object" in message
    assert "script" not in message


HOSTILE_ROLE = "<img src=x onerror=alert(1)>\r\nX-Injected: 1 " + "A" * 100_000


@pytest.mark.parametrize(
    ("url", "wrap"),
    [
        pytest.param(TURNS, lambda m: {"turn_id": "t-r", "messages": [m]}, id="a-turn"),
        pytest.param(f"{TURNS}/t-run/inbox/messages", lambda m: {"message": m}, id="a-delivery"),
    ],
)
@pytest.mark.parametrize("role", [HOSTILE_ROLE, "<b>x</b>"], ids=["long-markup", "markup"])
async def test_a_role_that_is_none_of_the_roles_is_refused_naming_the_roles_not_the_input(
    api: Served, url: str, wrap: Any, role: str
) -> None:
    body = json.dumps(wrap({"role": role, "content": "hi"})).encode()
    message = await refused(api, "POST", url, body, 422)
    assert "'role' must be one of 'system', 'user', 'assistant', 'tool', not <withheld>" in message
    assert not any(raw in message for raw in ("<b>", "img", "\r"))
    assert len(message) < 200


async def test_a_role_that_is_a_plain_name_but_no_role_is_shown(api: Served) -> None:
    body = json.dumps({"turn_id": "t-r", "messages": [{"role": "User", "content": "hi"}]})
    message = await refused(api, "POST", TURNS, body.encode(), 422)
    assert "'role' must be one of 'system', 'user', 'assistant', 'tool', not 'User'" in message


async def test_the_same_key_in_two_objects_is_no_duplicate(api: Served) -> None:
    messages = b'[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]'
    body = b'{"messages": ' + messages + b"}"
    response = await api.http.post(TURNS, content=body, headers=JSON)
    assert response.status_code == 201, response.text[:500]


# -- nesting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [100_000, 5_000, MAX_BODY_DEPTH])
async def test_a_body_nested_deeper_than_the_limit_is_refused_with_400(
    api: Served, depth: int
) -> None:
    # `params` opens at depth 5 of the body; `depth` more levels take it over the limit.
    message = await refused(api, "POST", TURNS, turn_with_params(f'{{"a": {nested(depth)}}}'), 400)
    assert f"nests deeper than {MAX_BODY_DEPTH} levels" in message
    message = await refused(api, "PATCH", CONV, f'{{"name": {nested(depth)}}}'.encode(), 400)
    assert f"nests deeper than {MAX_BODY_DEPTH} levels" in message


async def test_a_body_nested_within_the_limit_is_accepted(api: Served) -> None:
    params = f'{{"a": {nested(MAX_BODY_DEPTH - 7)}}}'
    response = await api.http.post(TURNS, content=turn_with_params(params), headers=JSON)
    assert response.status_code == 201, response.text[:500]


def test_a_body_within_the_rules_is_parsed_without_a_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Numbers are checked as they parse; only a body with more brackets than the limit
    has its nesting walked, only a refused number its path, and only a body with more `,`
    `:` `[` than the values limit has its values counted."""
    from app import json_body

    walks: list[str] = []
    for name in ("_values_in", "nests_deeper_than", "_name_the_number"):
        walk = getattr(json_body, name)
        monkeypatch.setattr(
            json_body, name, lambda *a, _w=walk, _n=name: walks.append(_n) or _w(*a)
        )
    turn = {"turn_id": "t", "messages": [{"role": "user", "content": "[{" * 20, "n": 2**62}]}
    assert json_body.decode_body(json.dumps(turn).encode()) == turn
    assert walks == []

    wide = json.dumps({"a": [[[{"b": [1, 2**63]}]]], "c": [[]] * 70})
    wide = wide.replace(str(2**63), "1e400").encode()  # past every double
    with pytest.raises(json_body.InvalidRequest, match=r"a\.0\.0\.0\.b\.1: the number"):
        json_body.decode_body(wide)
    assert walks == ["nests_deeper_than", "_name_the_number"]


# -- values ----------------------------------------------------------------------------------


def values_in(document: Any) -> int:
    """How many JSON values `document` holds, each object, array and scalar counting one."""
    if isinstance(document, dict):
        return 1 + sum(map(values_in, document.values()))
    if isinstance(document, list):
        return 1 + sum(map(values_in, document))
    return 1


def turn_of_rows(rows: int) -> bytes:
    return turn_with_params('{"rows": [' + ",".join(["{}"] * rows) + "]}")


async def test_a_body_of_more_values_than_the_limit_is_refused_with_413(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app import json_body

    body = turn_of_rows(40)
    monkeypatch.setattr(json_body, "MAX_BODY_VALUES", values_in(json.loads(body)) - 1)
    message = await refused(api, "POST", TURNS, body, 413)
    assert f"more than {values_in(json.loads(body)) - 1} JSON values" in message


async def test_a_body_of_as_many_values_as_the_limit_is_accepted(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app import json_body

    body = turn_of_rows(40)
    monkeypatch.setattr(json_body, "MAX_BODY_VALUES", values_in(json.loads(body)))
    response = await api.http.post(TURNS, content=body, headers=JSON)
    assert response.status_code == 201, response.text[:500]


async def test_commas_and_colons_inside_strings_are_no_values(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app import json_body

    monkeypatch.setattr(json_body, "MAX_BODY_VALUES", 50)
    content = ",:[" * 10_000
    body = json.dumps({"turn_id": "t-text", "messages": [{"role": "user", "content": content}]})
    response = await api.http.post(TURNS, content=body.encode(), headers=JSON)
    assert response.status_code == 201, response.text[:500]


async def test_a_turn_over_the_values_limit_is_refused_before_it_is_parsed(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the real limit: refused by a count of its bytes, before the body is parsed, pydantic
    validates it or anything is written (the probe's 2.5 million `{}` held the event loop for
    25 s; parsed before they were counted, 8 million `1,` held it for 5-12 s)."""
    from app import json_body
    from app.api_models import LogTurnBody

    validated: list[bytes] = []
    validate = LogTurnBody.model_validate_json

    def counted(raw: bytes, **options: Any) -> LogTurnBody:
        validated.append(raw)
        return validate(raw, **options)

    parsed: list[str] = []
    loads = json.loads
    monkeypatch.setattr(LogTurnBody, "model_validate_json", counted)
    monkeypatch.setattr(
        json_body,
        "json",
        type("Parser", (), {"loads": lambda *a, **k: parsed.append("!") or loads(*a, **k)}),
    )
    body = turn_of_rows(MAX_BODY_VALUES)
    assert values_in(json.loads(body)) > MAX_BODY_VALUES
    message = await refused(api, "POST", TURNS, body, 413)
    assert f"more than {MAX_BODY_VALUES} JSON values" in message
    assert (parsed, validated) == ([], [])


# Text that puts JSON's structural characters, escapes and white space inside strings.
_json_text = st.text(alphabet=st.sampled_from(list(',:[]{}"\\ \t\n\r/aé\u2028\x00')))
_json_documents: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _json_text,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_json_text, inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(
    document=_json_documents,
    indent=st.sampled_from([None, 0, 2, "\t", " \r\n "]),
    ascii_only=st.booleans(),
)
def test_the_values_counted_in_a_bodys_text_are_those_it_holds(
    document: Any, indent: Any, ascii_only: bool
) -> None:
    """The count made of the raw bytes, before any parse, is exact: 1 + `,` + `{` + `[`
    - `{}` - `[]` outside strings and white space."""
    from app import json_body

    raw = json.dumps(document, indent=indent, ensure_ascii=ascii_only).encode()
    assert json_body._values_in(json_body._unescaped(raw)) == values_in(document)


def sixteen_mib_of(unit: bytes) -> bytes:
    """A turn body of the turn cap (16 MiB) whose messages are `unit` after `unit`."""
    count = (16 * 2**20 - 100) // len(unit)
    return b'{"turn_id": "t", "messages": [' + unit * (count - 1) + unit[:-1] + b"]}"


@pytest.mark.parametrize(
    "unit",
    [b"1,", b"{},", b"0.5,", b"[],", b'"",', b'{"k": "v"},', b'"\\\\\\"",', b'",",'],
    ids=["integers", "empty-objects", "floats", "empty-arrays", "strings", "members",
         "escapes", "commas-in-strings"],
)  # fmt: skip
def test_a_body_of_more_values_than_the_limit_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch, unit: bytes
) -> None:
    """Counted in its bytes: the parser (a Python call per number) is never reached, so a
    body of the turn cap holds the event loop for no parse (8 million `1,` held it 5-12 s
    before the 413, every other request waiting)."""
    from app import json_body

    parsed: list[str] = []
    monkeypatch.setattr(
        json_body, "json", type("Parser", (), {"loads": lambda *_, **__: parsed.append("!")})
    )
    with pytest.raises(json_body.PayloadTooLarge, match=f"more than {MAX_BODY_VALUES} JSON"):
        json_body.decode_body(sixteen_mib_of(unit))
    assert parsed == []


@pytest.mark.parametrize("extra", [0, 1])
def test_a_body_at_the_values_limit_is_parsed_and_one_over_is_not(
    monkeypatch: pytest.MonkeyPatch, extra: int
) -> None:
    from app import json_body

    rows = MAX_BODY_VALUES - 3 + extra  # besides the body, its `turn_id` and `rows` array
    body = b'{"turn_id": "t", "rows": [' + b", ".join([b'"{[,"'] * rows) + b"]}"
    assert values_in(json.loads(body)) == MAX_BODY_VALUES + extra
    if extra:
        with pytest.raises(json_body.PayloadTooLarge):
            json_body.decode_body(body)
    else:
        assert json_body.decode_body(body)["rows"][0] == "{[,"


async def test_a_message_of_more_tool_calls_than_the_limit_is_refused_with_422(
    api: Served,
) -> None:
    calls = [{"id": f"c{n}", "function": {"name": "f"}} for n in range(MAX_TOOL_CALLS + 1)]
    turn = {"turn_id": "t-calls", "messages": [{"role": "assistant", "tool_calls": calls}]}
    message = await refused(api, "POST", TURNS, json.dumps(turn).encode(), 422)
    assert f"at most {MAX_TOOL_CALLS} items" in message


# -- content encoding ------------------------------------------------------------------------

PLAIN_TURN = b'{"turn_id": "t-enc", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    ("content", "encodings"),
    [
        pytest.param(gzip.compress(PLAIN_TURN), ["gzip"], id="gzip"),
        pytest.param(PLAIN_TURN, ["gzip"], id="plain-labelled-gzip"),
        pytest.param(PLAIN_TURN, ["zstd"], id="plain-labelled-zstd"),
        pytest.param(PLAIN_TURN, ["identity, br"], id="identity-then-br"),
        pytest.param(PLAIN_TURN, ["identity", "deflate"], id="two-lines"),
    ],
)
async def test_a_body_in_a_content_encoding_other_than_identity_is_refused_with_415(
    api: Served, content: bytes, encodings: list[str]
) -> None:
    """The service reads bodies as sent: a coding it would not undo is refused, not read as
    if it were plain (a real gzip body was "not UTF-8 text", a plain one labelled gzip stored)."""
    before = await api.digest()
    headers = [(k, v) for k, v in JSON.items()] + [("Content-Encoding", e) for e in encodings]
    response = await api.http.post(TURNS, content=content, headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (
        415,
        "unsupported_media_type",
    ), response.text
    assert "uncompressed" in response.json()["error"]["message"]
    assert await api.digest() == before


@pytest.mark.parametrize("encoding", ["identity", "Identity", " identity "])
async def test_a_body_in_the_identity_content_encoding_is_read(api: Served, encoding: str) -> None:
    headers = JSON | {"Content-Encoding": encoding}
    response = await api.http.post(TURNS, content=PLAIN_TURN, headers=headers)
    assert response.status_code == 201, response.text


# -- lone surrogates -----------------------------------------------------------------------


def lone_half(where: str, escape: str) -> str:
    return (
        f"invalid {where}: it holds a lone UTF-16 surrogate ({escape}), half of a character "
        "and no text: text must be valid Unicode"
    )


@pytest.mark.parametrize(
    ("method", "url", "body", "words"),
    [
        pytest.param("POST", TURNS, b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                     lone_half("message 0.content", "\\ud800"), id="high-in-content"),
        pytest.param("POST", TURNS, b'{"messages": [{"role": "user", "content": "a\\uDC00"}]}',
                     lone_half("message 0.content", "\\udc00"), id="low-in-content"),
        pytest.param("POST", TURNS, b'{"messages": [{"role": "user", "content": "x"}, '
                     b'{"role": "assistant", "content": "\\ud83d", "error": null}]}',
                     lone_half("message 1.content", "\\ud83d"), id="second-message"),
        pytest.param("POST", TURNS, b'{"messages": [{"role": "user", "content": "x", "native": '
                     b'{"format": "x", "set": {"\\ud800": 1}}}]}',
                     lone_half("message 0.native.set key", "\\ud800"), id="key-in-native"),
        pytest.param("POST", TURNS, b'{"messages": [{"role": "user", "content": "x", "native": '
                     b'{"format": "x", "set": {"<b>k</b>": ["\\udbff"]}}}]}',
                     lone_half("message 0.native.set.<key>.0", "\\udbff"), id="under-a-key"),
        pytest.param("POST", TURNS, b'{"turn_id": "\\ud800", "messages": [{"role": "user", '
                     b'"content": "x"}]}', lone_half("turn_id", "\\ud800"), id="turn-id"),
        pytest.param("PATCH", CONV, b'{"name": "Trip \\udfff"}', lone_half("name", "\\udfff"),
                     id="rename"),
        pytest.param("POST", f"{CONV}/turns/run-1/inbox/messages",
                     b'{"message": {"role": "user", "content": "\\ud800\\ud800"}}',
                     lone_half("message.content", "\\ud800"), id="delivery"),
    ],
)  # fmt: skip
async def test_a_lone_surrogate_in_a_body_is_refused_naming_where_it_is_in_the_stores_words(
    api: Served, method: str, url: str, body: bytes, words: str
) -> None:
    """Not the parser's words ("unexpected end of hex escape", a low half called "leading"):
    a turn's message is named as the store names it, any other value by its field."""
    assert (await api.http.post(f"{CONV}/turns/run-1/inbox", headers=SERVICE)).status_code == 200
    assert await refused(api, method, url, body, 422) == words


async def test_a_surrogate_pair_escaped_in_a_body_is_one_character(api: Served) -> None:
    content = b'"\\ud83d\\ude00 \\\\ud800"'  # a pair, and a backslash before `ud800`
    body = b'{"turn_id": "t-pair", "messages": [{"role": "user", "content": ' + content + b"}]}"
    response = await api.http.post(TURNS, content=body, headers=JSON)
    assert response.status_code == 201, response.text
    assert response.json()["messages"][0]["content"] == "\U0001f600 \\ud800"


@pytest.mark.parametrize(
    ("text", "escape"),
    [
        pytest.param(r"[10000000000000000000000000, \"\\ud800\"]", "\\ud800", id="in-a-value"),
        pytest.param(r"{\"\\udfff\": 1e400}", "\\udfff", id="in-a-key"),
    ],
)
async def test_a_native_json_text_spelling_a_lone_surrogate_is_refused_as_the_value_would_be(
    api: Served, text: str, escape: str
) -> None:
    """The text is ASCII; the value it spells, which a runtime is given back, is no text."""
    native = f'{{"format": "langchain", "set": {{"k": "{text}"}}, "json_text": ["k"]}}'
    message = f'{{"role": "assistant", "content": "x", "native": {native}}}'
    body = f'{{"turn_id": "t-forged", "messages": [{message}]}}'.encode()
    words = await refused(api, "POST", TURNS, body, 422)
    assert "json_text names k" in words
    assert f"lone UTF-16 surrogate ({escape})" in words


# -- routes that take no body ----------------------------------------------------------------

NO_BODY_ROUTES = [
    pytest.param("DELETE", CONV, "/v1/conversations/{conversation_id}", id="delete-conversation"),
    pytest.param("DELETE", f"/v1/users/{OWNER}", "/v1/users/{user_id}", id="erase-user"),
    pytest.param(
        "POST",
        f"{CONV}/turns/run-9/inbox",
        "/v1/conversations/{conversation_id}/turns/{turn_id}/inbox",
        id="open-inbox",
    ),
    pytest.param("GET", CONV, "/v1/conversations/{conversation_id}", id="get-conversation"),
]


@pytest.mark.parametrize(("method", "url", "route"), NO_BODY_ROUTES)
@pytest.mark.parametrize(
    "content", [b'{"dry_run": true}', b'{"messages_only": true}', b"{}", b"[]", b"x"]
)
async def test_a_body_sent_to_a_route_that_takes_none_is_refused_with_422(
    api: Served, method: str, url: str, route: str, content: bytes
) -> None:
    """Not passed over: `DELETE /v1/users/{id}` with `{"dry_run": true}` erased everything."""
    message = await refused(api, method, url, content, 422)
    assert message == (
        f"{method} {route} takes no body: send the request without one (its options, if any, "
        "are query parameters)"
    )


@pytest.mark.parametrize(("method", "url", "route"), NO_BODY_ROUTES)
async def test_a_body_that_is_no_json_sent_to_a_route_that_takes_none_is_refused_with_415(
    api: Served, method: str, url: str, route: str
) -> None:
    before = await api.digest()
    headers = SERVICE | {"Content-Type": "text/plain"}
    response = await api.http.request(method, url, content=b"not json at all", headers=headers)
    assert (response.status_code, response.json()["error"]["code"]) == (
        415,
        "unsupported_media_type",
    ), response.text
    assert f"{method} {route} takes no body" in response.json()["error"]["message"]
    assert await api.digest() == before


@pytest.mark.parametrize("content", [b"", b" \r\n\t "])
@pytest.mark.parametrize("content_type", ["application/json", "text/plain", None])
async def test_an_empty_body_is_no_body(
    api: Served, content: bytes, content_type: str | None
) -> None:
    headers = SERVICE | ({"Content-Type": content_type} if content_type else {})
    response = await api.http.request("DELETE", CONV, content=content, headers=headers)
    assert response.status_code == 200, response.text


# -- names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("\u200f", id="right-to-left-mark"),
        pytest.param("\u200e", id="left-to-right-mark"),
        pytest.param("\u061c", id="arabic-letter-mark"),
        pytest.param("Invoice \u200fcod.exe", id="mark-inside"),
        pytest.param("\u200b", id="zero-width-space"),
        pytest.param("\u2060", id="word-joiner"),
        pytest.param("\ufeff", id="byte-order-mark"),
        pytest.param("\u3164", id="hangul-filler"),
        pytest.param("\u115f", id="hangul-choseong-filler"),
        pytest.param("\u200b\u200f\u200e", id="marks-and-zero-width"),
        pytest.param("\U000e0041\U000e0042", id="tag-characters"),
    ],
)
async def test_a_name_that_shows_nothing_or_holds_a_direction_mark_is_refused_with_422(
    api: Served, name: str
) -> None:
    message = await refused(api, "PATCH", CONV, json.dumps({"name": name}).encode(), 422)
    assert "name" in message


@pytest.mark.parametrize(
    ("method", "url", "body"),
    [
        pytest.param("POST", "/v1/conversations/%2E%2E/turns",
                     {"turn_id": "t-1", "messages": [{"role": "user", "content": "x"}]},
                     id="conversation-in-the-path"),
        pytest.param("POST", "/v1/conversations/conv-dots/turns",
                     {"turn_id": "t-1", "user_id": "..",
                      "messages": [{"role": "user", "content": "x"}]},
                     id="user-in-the-body"),
        pytest.param("POST", "/v1/conversations/conv-dots/turns",
                     {"turn_id": ".", "messages": [{"role": "user", "content": "x"}]},
                     id="turn-in-the-body"),
        pytest.param("POST", f"{CONV}/forks", {"at_seq": 0, "new_conversation_id": "."},
                     id="fork-to"),
        pytest.param("DELETE", "/v1/users/%2E%2E", None, id="user-in-the-path"),
    ],
)  # fmt: skip
async def test_a_dot_or_two_dots_as_an_id_is_refused_with_422(
    api: Served, method: str, url: str, body: Any
) -> None:
    """A URL path reads `.` and `..` as the folder itself and its parent: no id is either."""
    content = json.dumps(body).encode() if body is not None else b""
    message = await refused(api, method, url, content, 422)
    assert "a URL path" in message


# -- numbers ---------------------------------------------------------------------------------

PAST_DOUBLES = "1" + "0" * 400
"""An integer past every double: no number the store keeps, however spelt."""

HUGE_NUMBERS = [
    pytest.param(
        '{"role": "user", "content": "x", "upload": '
        f'{{"filename": "a.pdf", "file_type": "application/pdf", "size": {2**63}}}}}',
        "messages.0.upload.size",
        "less than or equal to 9007199254740991",
        id="upload-size-2**63",
    ),
    pytest.param(
        '{"role": "assistant", "content": "x", "token_usage": '
        f'{{"input_tokens": {2**64}, "output_tokens": 1}}}}',
        "messages.0.token_usage.input_tokens",
        "less than or equal to 9007199254740991",
        id="token-usage-2**64",
    ),
    pytest.param(
        f'{{"role": "assistant", "content": "x", "latency_ms": {-(2**63) - 1}}}',
        "messages.0.latency_ms",
        "past 64 bits and its digits name no 64-bit floating-point number",
        id="latency-below-int64",
    ),
    pytest.param(
        '{"role": "assistant", "content": "x", "hitl_action": {"action": "pay", '
        f'"request_id": "r", "params": {{"amount": {PAST_DOUBLES}}}}}}}',
        "messages.0.hitl_action.params.amount",
        "64-bit",
        id="hitl-param-10**400",
    ),
    pytest.param(
        '{"role": "assistant", "content": "x", "hitl_action": {"action": "pay", '
        '"request_id": "r", "params": {"amount": 1e400}}}',
        "messages.0.hitl_action.params.amount",
        "64-bit",
        id="hitl-param-1e400",
    ),
    pytest.param(  # keys named like roles are the sender's keys here, shown as they are
        '{"role": "assistant", "content": "x", "hitl_action": {"action": "pay", '
        f'"request_id": "r", "params": {{"user": {{"tool": [{PAST_DOUBLES}]}}}}}}}}',
        "messages.0.hitl_action.params.user.tool.0",
        "64-bit",
        id="hitl-param-under-role-named-keys",
    ),
    pytest.param(  # past the digits Python's int() reads at all
        f'{{"role": "assistant", "content": "x", "latency_ms": {"9" * 4301}}}',
        "messages.0.latency_ms",
        "64-bit",
        id="latency-4301-digits",
    ),
    pytest.param(
        f'{{"role": "assistant", "content": "x", "latency_ms": -{"1" * 100_000}}}',
        "messages.0.latency_ms",
        "64-bit",
        id="latency-minus-100000-digits",
    ),
]


@pytest.mark.parametrize(("message", "where", "why"), HUGE_NUMBERS)
async def test_numbers_no_field_keeps_are_refused_with_422_naming_it(
    backend: Backend, message: str, where: str, why: str
) -> None:
    """An integer past 64 bits is the double it spells: a count bounded below it refuses it
    as it would that double, and past every double it is no number the store keeps."""
    async with serve(backend.db) as api:
        body = f'{{"turn_id": "t-big", "messages": [{message}]}}'.encode()
        text = await refused(api, "POST", TURNS, body, 422)
        assert where in text
        assert why in text


BIG_WHOLE_TURNS = [
    pytest.param(
        '{"role": "assistant", "content": "ok?", "created_at": "2026-01-01T00:00:01Z", '
        '"hitl_action": {"action": "pay", "request_id": "q1", "params": {"amount": %s}}}',
        id="prompt-params",
    ),
    pytest.param(
        '{"role": "assistant", "content": null, "created_at": "2026-01-01T00:00:01Z", '
        '"tool_calls": [{"id": "c1", "function": {"name": "pay", "arguments": {"amount": %s}}}]}',
        id="call-arguments",
    ),
]


@pytest.mark.parametrize("message", BIG_WHOLE_TURNS)
@pytest.mark.parametrize("keyed", [True, False], ids=["idempotency-key", "derived-id"])
async def test_a_whole_number_past_64_bits_is_one_number_however_spelt(
    api: Served, message: str, keyed: bool
) -> None:
    """`1e+19` (Python's spelling) and `10000000000000000000` (JavaScript's) are one JSON
    number: both are kept as that double, so the retry of a turn holding it, spelt the other
    way, is the turn again, never invalid input."""
    headers = JSON | ({"Idempotency-Key": "k-big"} if keyed else {})
    asked = '{"role": "user", "content": "pay", "created_at": "2026-01-01T00:00:00Z"}'
    turn = '{"messages": [' + asked + ", %s]}"

    first = await api.http.post(TURNS, content=turn % (message % "1e+19"), headers=headers)
    retry = await api.http.post(
        TURNS, content=turn % (message % "10000000000000000000"), headers=headers
    )

    assert first.status_code == 201, first.text[:500]
    assert retry.status_code == 200, retry.text[:500]
    assert retry.json()["messages"] == first.json()["messages"]
    assert "1e+19" in retry.text


@pytest.mark.parametrize("message", BIG_WHOLE_TURNS)
@pytest.mark.parametrize("digits", ["10000000000000000001", "9223372036854775809"])
async def test_a_whole_number_past_64_bits_no_double_holds_is_refused_naming_it(
    api: Served, message: str, digits: str
) -> None:
    """Digits past 64 bits that name no double exactly (nor as its shortest digits) would be
    kept as the nearest double, losing digits silently: 422 naming the number's place,
    nothing written. Such a number is sent as a string."""
    before = await api.digest()
    asked = '{"role": "user", "content": "pay", "created_at": "2026-01-01T00:00:00Z"}'
    turn = '{"messages": [' + asked + ", " + message % digits + "]}"

    refused = await api.http.post(TURNS, content=turn, headers=JSON)

    assert refused.status_code == 422, refused.text[:500]
    said = refused.json()["error"]["message"]
    assert "messages.1." in said
    assert "digits" in said
    assert await api.digest() == before


@pytest.mark.parametrize(
    "declared",
    [
        pytest.param(b"\xb2", id="superscript-two"),  # read as latin-1: "\u00b2".isdigit()
        pytest.param(b"2\xb9", id="superscript-one-after-a-digit"),
        pytest.param(b"1" * 5000, id="past-int-conversion-limit"),
        pytest.param(b"+2", id="signed"),
    ],
)
async def test_a_content_length_not_a_byte_count_in_ascii_digits_is_refused(
    api: Served, declared: bytes
) -> None:
    before = await api.digest()
    headers = httpx.Headers([*JSON.items(), ("Content-Length", declared)])  # bytes kept as sent
    response = await api.http.request("PATCH", CONV, headers=headers, content=b"{}")
    assert response.status_code == 422, response.text[:300]
    assert "Content-Length" in response.json()["error"]["message"]
    assert await api.digest() == before


# -- search ----------------------------------------------------------------------------------


@pytest.mark.parametrize("q", ["-a -b", "-paris", '-"in paris"', "--a", '- -"in"'])
async def test_a_search_of_only_excluded_words_is_refused_saying_so(
    backend: Backend, q: str
) -> None:
    assert await _search_refusal(backend, q) == (
        "invalid search: the query needs at least one word to find, not only words "
        "excluded with '-'"
    )


@pytest.mark.parametrize("q", ["\\", "\x00", '"', '""', "¿?", "-", "!!!", "- -"])
async def test_a_search_holding_no_word_is_refused_saying_it_holds_none(
    backend: Backend, q: str
) -> None:
    """Nothing was excluded: the message says there is no word, not that words were excluded."""
    assert await _search_refusal(backend, q) == (
        "invalid search: the query holds no word to search for (a word holds a letter or a digit)"
    )


async def _search_refusal(backend: Backend, q: str) -> str:
    """The message of the 422 a search of `q` answers."""
    async with serve(backend.db) as api:
        response = await api.http.get(
            "/v1/search", params={"q": q, "user_id": OWNER}, headers=SERVICE
        )
    assert response.status_code == 422, response.text
    message: str = response.json()["error"]["message"]
    return message


@pytest.mark.parametrize("q", ["paris -lyon", '"in paris"', "- paris", "the"])
async def test_a_search_with_a_positive_term_is_run(backend: Backend, q: str) -> None:
    backend.skip_if_lacking("text_search")
    async with serve(backend.db) as api:
        response = await api.http.get(
            "/v1/search", params={"q": q, "user_id": OWNER}, headers=SERVICE
        )
        assert response.status_code == 200, response.text


async def test_a_search_answers_at_most_a_page_of_bytes_and_says_how_to_read_on(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`limit=200` of large matching messages: the answer holds what fits in `PAGE_BYTES`
    (one hit at least), says `has_more`, and `cursor=next_cursor` serves the rest."""
    backend.skip_if_lacking("text_search")
    monkeypatch.setattr("agent_store.store._reads.PAGE_BYTES", 20_000)  # two messages
    async with serve(backend.db) as api:
        user = auth_headers(user=OWNER)
        turn = [{"role": "user", "content": f"zanzibar {n} {'x' * 4_000}"} for n in range(5)]
        posted = await api.http.post("/v1/conversations/bulky/turns",
                                     json={"messages": turn}, headers=user)  # fmt: skip
        assert posted.status_code == 201, posted.text
        params: dict[str, Any] = {"q": "zanzibar", "limit": 200}
        sizes, served, ranks = [], [], []
        while True:
            found = await api.http.get("/v1/search", params=params, headers=user)
            assert found.status_code == 200, found.text
            body = found.json()
            sizes.append(len(body["data"]))
            served.append(len(found.content))
            ranks += [hit["rank"] for hit in body["data"]]
            if not body["has_more"]:
                assert body["next_cursor"] is None
                break
            params["cursor"] = body["next_cursor"]
        assert (sizes, ranks) == ([2, 2, 1], [1, 2, 3, 4, 5])
        assert max(served) < 20_000
        forged = await api.http.get(
            "/v1/search", params={**params, "cursor": "eyIkbmUiOiAxfQ"}, headers=user
        )
        assert forged.status_code == 422
        assert "invalid cursor" in forged.json()["error"]["message"]


# -- the driver's text -----------------------------------------------------------------------


async def test_a_database_error_reaches_the_client_without_the_drivers_text(
    wire_backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve(wire_backend.db) as api:
        # Without its text index, the database refuses every search.
        indexes = await api.db[MESSAGES].index_information()
        text_index = next(name for name, spec in indexes.items() if "text" in str(spec["key"]))
        await api.db[MESSAGES].drop_index(text_index)
        with caplog.at_level(logging.ERROR, logger="agent_store.api"):
            response = await api.http.get(
                "/v1/search", params={"q": "Paris", "user_id": OWNER}, headers=SERVICE
            )
        assert response.status_code == 500
        error = response.json()["error"]
        assert error == {
            "code": "storage_failure",
            "message": "could not search messages: the database refused the operation",
        }
        assert "errmsg" not in response.text
        # The operator still finds the driver's words in the server log.
        assert "text index" in caplog.text.lower()


# -- erasing and empty $in lists -------------------------------------------------------------


async def test_erasing_users_after_a_migration_works_on_every_backend(backend: Backend) -> None:
    async with serve(backend.db) as api:
        # The harness keeps the example's legacy turns beside its migrated messages.
        erased = await api.http.delete(f"/v1/users/{OWNER}", headers=SERVICE)
        assert erased.status_code == 200, erased.text
        assert erased.json()["legacy_turns"] == 4
        no_legacy = await api.http.delete(f"/v1/users/{OTHER}", headers=SERVICE)
        assert no_legacy.status_code == 200, no_legacy.text
        assert no_legacy.json()["legacy_turns"] == 0


class EmptyInLists(monitoring.CommandListener):
    """Remembers every command that holds an `$in` with an empty list."""

    def __init__(self) -> None:
        self.found: list[str] = []

    @staticmethod
    def _holds_empty_in(value: Any) -> bool:
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                if item.get("$in") == []:
                    return True
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return False

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if self._holds_empty_in(dict(event.command)):
            self.found.append(json.dumps(dict(event.command), default=str)[:300])

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.wire
async def test_no_route_sends_an_empty_in_list(wire_uri: str) -> None:
    listener = EmptyInLists()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
        wire_uri, tz_aware=True, event_listeners=[listener]
    )
    db = client["empty_in_lists"]
    hitl = f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl"
    requests: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", f"/v1/users/{OWNER}/conversations", None),
        ("GET", CONV, None),
        ("GET", f"{CONV}/transcript", None),
        ("GET", f"{CONV}/messages", None),
        ("GET", f"/v1/users/{OWNER}/export", None),
        ("GET", "/v1/search?q=Paris&user_id=user-ada", None),
        ("POST", TURNS, {"messages": [{"role": "user", "content": "again"}]}),
        ("PATCH", CONV, {"name": "Renamed"}),
        ("GET", hitl, None),
        ("POST", f"{hitl}/resolve", {"request_id": "req-ada"}),
        ("POST", "/v1/claims", {"from_user_id": OTHER, "to_user_id": "user-grace-2"}),
        ("DELETE", CONV, None),
        ("DELETE", f"/v1/users/{OWNER}", None),
        ("DELETE", "/v1/users/user-nobody", None),
        ("GET", "/v1/conversations/missing/transcript", None),
    ]
    try:
        async with serve(db) as api:
            for user in (None, OWNER):
                for method, url, body in requests:
                    headers = auth_headers(user=user)
                    response = await api.http.request(method, url, json=body, headers=headers)
                    assert response.status_code < 500, (method, url, response.text)
    finally:
        await client.drop_database("empty_in_lists")
        await client.close()
    assert listener.found == []


# -- resolving a prompt ----------------------------------------------------------------------

HITL = f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl/resolve"
A_CALL = {"tool_call_id": "call_0", "message_id": "msg-1"}


@pytest.mark.parametrize(
    ("calls", "where"),
    [
        pytest.param('"call_0"', "calls", id="a-string"),
        pytest.param(json.dumps(A_CALL), "calls", id="one-call-not-in-a-list"),
        pytest.param('[{"tool_call_id": "call_0"}]', "calls.0.message_id", id="no-message-id"),
        pytest.param(
            '[{"tool_call_id": "", "message_id": "m"}]', "calls.0.tool_call_id", id="empty-id"
        ),
        pytest.param(
            json.dumps([A_CALL | {"request_id": "req-ada"}]), "calls.0.request_id", id="another-key"
        ),
        pytest.param(
            json.dumps([A_CALL | {"message_id": {"$ne": None}}]),
            "calls.0.message_id",
            id="operator",
        ),
        pytest.param(json.dumps([A_CALL] * 101), "calls", id="101-calls"),
    ],
)
async def test_a_resolution_naming_calls_not_as_call_identities_is_refused_with_422(
    api: Served, calls: str, where: str
) -> None:
    body = f'{{"request_id": "req-ada", "calls": {calls}}}'.encode()
    assert where in await refused(api, "POST", HITL, body, 422)


async def test_a_resolution_naming_calls_both_ways_is_refused_with_422(api: Served) -> None:
    body = json.dumps({"request_id": "req-ada", "call_ids": ["call_0"], "calls": [A_CALL]})
    message = await refused(api, "POST", HITL, body.encode(), 422)
    assert "send calls or call_ids, not both" in message


@pytest.mark.parametrize("field", ["call_ids", "calls"])
async def test_a_resolution_naming_an_empty_list_of_calls_is_refused_with_422(
    api: Served, field: str
) -> None:
    """An empty list names no call an answer could concern: a 422 naming the field, not a
    409 a retry cannot fix (leave the field out to answer whatever the prompt holds)."""
    body = json.dumps({"request_id": "req-ada", field: []})
    message = await refused(api, "POST", HITL, body.encode(), 422)
    assert field in message
    assert "at least 1" in message


# -- what a refusal repeats of the request --------------------------------------------------

MARKUP_CALL = "<img src=x onerror=alert(1)>\u202eevil"
MARKUP_MESSAGE = "<script>steal()</script>"


async def test_an_answers_to_refusal_shows_ids_that_are_no_plain_names_as_withheld(
    api: Served,
) -> None:
    """SECURITY.md: a caller's value that is not a plain name (a tool call id, a message id it
    names) is shown as `<withheld>`, also where `answers_to` names a message that does not
    make the call."""
    call = {"id": MARKUP_CALL, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asks = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [call]}]
    url = "/v1/conversations/conv-echo/turns"
    first = await api.http.post(url, json={"turn_id": "t0", "messages": asks}, headers=SERVICE)
    assert first.status_code == 201, first.text
    answer = {"role": "tool", "tool_call_id": MARKUP_CALL, "content": "done"}
    body = {"turn_id": "t1", "messages": [answer], "answers_to": {MARKUP_CALL: MARKUP_MESSAGE}}

    message = await refused(api, "POST", url, json.dumps(body).encode(), 422)

    assert "message <withheld> does not make call <withheld>" in message
    assert not any(raw in message for raw in ("<img", "<script", "\u202e"))


async def test_a_dollar_key_of_native_set_is_shown_as_key_and_only_a_few_are_listed(
    api: Served,
) -> None:
    """SECURITY.md: a body key that is not a plain name is shown as `<key>`; a refusal lists
    the first few such keys and counts the rest, whatever their number and length."""
    long_key = "$<script>alert(1)</script>" + "A" * 20_000
    keys = [long_key, long_key + "B", "$set", *(f"$k{n}" for n in range(20))]
    native = {"format": "openai-agents", "set": dict.fromkeys(keys, 1)}
    body = {"turn_id": "t1", "messages": [{"role": "assistant", "content": "x", "native": native}]}

    message = await refused(api, "POST", TURNS, json.dumps(body).encode(), 422)

    assert "native keys must not start with `$`: <key>, <key>, $set and 20 more" in message
    assert "script" not in message
    assert len(message) < 300


A_TURN = {"messages": [{"role": "user", "content": "x"}]}
NAME_REFUSALS = [
    pytest.param("PATCH", CONV, {"name": "invoice \u202egpj.exe"},
                 "it holds U+202E at character 8, a control or text-direction character",
                 id="patch-direction-override"),
    pytest.param("POST", TURNS, {"turn_id": "t-n", "name": "\u200b", **A_TURN},
                 "show something besides invisible characters", id="turn-name-invisible"),
    pytest.param("POST", TURNS, {"turn_id": "a b", **A_TURN},
                 "an id is 1-200 characters of", id="turn-id-with-a-space"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "url", "body", "words"), NAME_REFUSALS)
async def test_a_value_refused_for_its_form_says_what_is_wrong_in_words_never_the_pattern(
    api: Served, method: str, url: str, body: dict[str, Any], words: str
) -> None:
    message = await refused(api, method, url, json.dumps(body).encode(), 422)

    assert words in message
    assert "pattern" not in message
    assert all(c.isprintable() for c in message), ascii(message)
    assert len(message) < 200


def _patterns(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        found = {schema["pattern"]} if isinstance(schema.get("pattern"), str) else set()
        return found.union(*(_patterns(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_patterns(v) for v in schema))
    return set()


async def test_every_pattern_the_service_checks_is_refused_in_words_of_its_own(
    api: Served,
) -> None:
    """Each `pattern` the OpenAPI document names (the API's and the stored shapes' alike) has
    words saying what a value lacks: a refusal never shows a pattern, nor the generic words
    kept for a pattern no one described."""
    document = (await api.http.get("/openapi.json")).json()
    patterns = _patterns(document)
    assert len(patterns) >= 3
    for pattern in patterns:
        adapter = TypeAdapter(Annotated[str, StringConstraints(pattern=pattern)])
        with pytest.raises(ValidationError) as refusal:
            adapter.validate_python("\x00 $")
        text = describe_validation_error(refusal.value)
        assert pattern not in text
        assert "pattern" not in text
        assert UNDESCRIBED_PATTERN not in text, pattern


# JSON Schema's `integer` is any number with no fractional part: `120.0` and `1E2` are integers.
WHOLE_NUMBERS_WITH_A_FRACTION_PART = [
    pytest.param(
        b'{"role": "assistant", "content": "hi", "latency_ms": 120.0}',
        {"latency_ms": 120},
        id="latency-120.0",
    ),
    pytest.param(
        b'{"role": "assistant", "content": "hi",'
        b' "token_usage": {"input_tokens": 1E2, "output_tokens": 5.0}}',
        {"token_usage": {"input_tokens": 100, "output_tokens": 5}},
        id="tokens-1E2-and-5.0",
    ),
]


@pytest.mark.parametrize(("message", "stored"), WHOLE_NUMBERS_WITH_A_FRACTION_PART)
async def test_an_integer_written_with_a_zero_fraction_is_an_integer_and_stored_as_one(
    api: Served, message: bytes, stored: dict[str, Any]
) -> None:
    body = b'{"turn_id": "t-whole", "messages": [' + message + b"]}"
    response = await api.http.post(TURNS, content=body, headers=JSON)

    assert response.status_code == 201, response.text
    document = await api.db[MESSAGES].find_one({"turn_id": "t-whole"})
    assert document is not None
    for key, value in stored.items():
        assert document[key] == value
        assert json.dumps(document[key]) == json.dumps(value)  # ints, not floats


async def test_a_fork_at_a_seq_written_with_a_zero_fraction_is_made(api: Served) -> None:
    body = b'{"at_seq": 1.0, "new_conversation_id": "fork-whole"}'
    response = await api.http.post(f"{CONV}/forks", content=body, headers=JSON)

    assert response.status_code == 201, response.text


NO_INTEGERS = [
    pytest.param(b"120.5", "valid integer", id="fraction"),
    pytest.param(b'"120"', "valid integer", id="string"),
    pytest.param(b"true", "valid integer", id="boolean"),
    pytest.param(b"1E300", "less than or equal to", id="past-64-bits-as-a-float"),
    pytest.param(b"-1.0", "greater than or equal to", id="negative"),
]


@pytest.mark.parametrize(("value", "said"), NO_INTEGERS)
async def test_a_number_with_a_fraction_or_no_number_is_still_no_integer(
    api: Served, value: bytes, said: str
) -> None:
    body = b'{"messages": [{"role": "assistant", "content": "x", "latency_ms": ' + value + b"}]}"
    text = await refused(api, "POST", TURNS, body, 422)

    assert "messages.0.latency_ms" in text
    assert said in text


# -- objects MongoDB reads back as a database reference -------------------------------------

SCHEMA = {
    "$id": "https://example.com/city.json",
    "$ref": "#/$defs/city",
    "$defs": {"city": {"type": "string"}},
}
"""A JSON Schema: a text `$ref` beside an `$id`, which MongoDB drivers read as a DBRef."""


async def test_a_prompt_whose_params_hold_a_dbref_shape_is_refused_naming_where(
    wire_backend: Backend,
) -> None:
    async with serve(wire_backend.db) as api:
        body = json.dumps(
            {
                "user_id": OWNER,
                "turn_id": "t-schema",
                "messages": [
                    {"role": "user", "content": "Book me a city tour"},
                    {
                        "role": "assistant",
                        "content": "Which city?",
                        "hitl_action": {
                            "action": "form",
                            "request_id": "r-1",
                            "params": {"schema": SCHEMA},
                        },
                    },
                ],
            }
        ).encode()
        message = await refused(api, "POST", TURNS, body, 422)
    assert "message 1 hitl_action.params.schema" in message
    assert "DBRef" in message


async def test_a_stored_dbref_is_served_as_the_object_it_was_written_as(
    wire_backend: Backend,
) -> None:
    """Written by another app, or before the store refused such params: the conversation,
    its owner's list and export read it back as the plain object."""
    async with serve(wire_backend.db) as api:
        ref = DBRef(SCHEMA["$ref"], SCHEMA["$id"], _extra={"$defs": SCHEMA["$defs"]})
        hitl = f"/v1/conversations/{OWNER_HITL_CONVERSATION}"
        await api.db[MESSAGES].update_one(
            {"conversation_id": OWNER_HITL_CONVERSATION, "hitl_action": {"$ne": None}},
            {"$set": {"hitl_action.params.schema": ref}},
        )
        await api.db[CONVERSATIONS].update_one(
            {"_id": OWNER_HITL_CONVERSATION}, {"$set": {"pending_hitl.params.schema": ref}}
        )
        for path in (
            f"{hitl}/messages",
            f"{hitl}/transcript",
            f"{hitl}/hitl",
            hitl,
            f"/v1/users/{OWNER}/conversations",
            f"/v1/users/{OWNER}/export?format=jsonl",
        ):
            for headers in (SERVICE, auth_headers(user=OWNER)):
                response = await api.http.get(path, headers=headers)
                assert response.status_code == 200, (path, response.text[:300])
                assert json.dumps(SCHEMA["$defs"], separators=(",", ":")) in response.text, path


# -- JSON held in strings ---------------------------------------------------------------------

WIDE_TEXT = "[" + ",".join(["{}"] * MAX_BODY_VALUES) + "]"
"""JSON text of one value more than a body may hold (`MAX_BODY_VALUES`), as a string."""
DEEP_TEXT = nested(3_000, "1,2")
"""JSON text nested past what Python's recursion reaches (6 KB), as a string."""


def called_with(arguments: str) -> bytes:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return json.dumps({"turn_id": "t-json-text", "messages": [message]}).encode()


def walked_values(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The JSON values the store walks to put arguments in key order (`_normal_json`)."""
    walked: list[object] = []
    normal = _turns._normal_json

    def counted(value: object) -> object:
        walked.append(value)
        return normal(value)

    monkeypatch.setattr(_turns, "_normal_json", counted)
    return walked


@pytest.mark.parametrize("text", [WIDE_TEXT, DEEP_TEXT], ids=["wide", "deep"])
@pytest.mark.parametrize("headers", [SERVICE, auth_headers(user=OWNER)], ids=["service", "user"])
async def test_arguments_text_past_the_bounds_of_json_the_store_walks_is_kept_as_written(
    api: Served, monkeypatch: pytest.MonkeyPatch, text: str, headers: dict[str, str]
) -> None:
    """Arguments are kept as the caller sent them, JSON or not. JSON text holding more values
    than a body may (`MAX_BODY_VALUES`) or nested deeper than a value may
    (`MAX_PARAMS_DEPTH`) is compared with a retry as written, never walked to sort its keys
    (14 MB of `[[],[],…]` held the event loop 4.6 s; nested 3,000 deep it answered 500): 201,
    its retry a replay, no more values walked than the bound."""
    walked = walked_values(monkeypatch)
    sent = await api.http.post(TURNS, content=called_with(text), headers=JSON | headers)
    assert sent.status_code == 201, sent.text[:300]
    again = await api.http.post(TURNS, content=called_with(text), headers=JSON | headers)
    assert again.status_code == 200, again.text[:300]
    assert len(walked) <= MAX_BODY_VALUES
    stored = await api.db[MESSAGES].find_one({"turn_id": "t-json-text"})
    assert stored is not None
    assert stored["tool_calls"][0]["function"]["arguments"] == text


async def test_a_native_json_text_holding_more_values_than_a_body_may_is_refused(
    api: Served,
) -> None:
    """A native value kept as JSON text counts its values as the body would: over
    `MAX_BODY_VALUES`, 422 naming the key and the bound, before the text is parsed (it was
    parsed and walked, 4.5 s for 14 MB, then refused for another reason)."""
    native = {"format": "langchain", "set": {"k": WIDE_TEXT}, "json_text": ["k"]}
    message = {"role": "assistant", "content": "x", "native": native}
    body = json.dumps({"turn_id": "t-native", "messages": [message]}).encode()
    words = await refused(api, "POST", TURNS, body, 422)
    assert "json_text names k" in words
    assert f"more than {MAX_BODY_VALUES} JSON values" in words
