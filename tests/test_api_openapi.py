"""`/openapi.json` says what the service does: every status a route gives, every body it takes."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from agent_store.legacy import LEGACY_TURNS
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

SERVICE = auth_headers()
CONV = f"/v1/conversations/{OWNER_CONVERSATION}"
LEGACY_ONLY = "conv-legacy-only"
HITL = f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl"
TURN = {"messages": [{"role": "user", "content": "hi"}]}
JSON_BODY = SERVICE | {"Content-Type": "application/json"}

# (method, url, body (object, or raw bytes), headers, expected status)
Case = tuple[str, str, Any, dict[str, str], int]
CASES: dict[str, Case] = {
    "health": ("GET", "/health", None, {}, 200),
    "ready": ("GET", "/ready", None, SERVICE, 200),
    "list": ("GET", f"/v1/users/{OWNER}/conversations", None, SERVICE, 200),
    "list-of-another-user": (
        "GET",
        f"/v1/users/{OWNER}/conversations",
        None,
        auth_headers(user=OTHER),
        403,
    ),
    "list-bad-cursor": ("GET", f"/v1/users/{OWNER}/conversations?cursor=x", None, SERVICE, 422),
    "get": ("GET", CONV, None, SERVICE, 200),
    "get-no-token": ("GET", CONV, None, {}, 401),
    "get-missing": ("GET", "/v1/conversations/missing", None, SERVICE, 404),
    "get-bad-id": ("GET", "/v1/conversations/bad%20id", None, SERVICE, 422),
    "rename": ("PATCH", CONV, {"name": "Trip"}, SERVICE, 200),
    "rename-legacy-only": (
        "PATCH",
        f"/v1/conversations/{LEGACY_ONLY}",
        {"name": "x"},
        SERVICE,
        409,
    ),
    "rename-spaces": ("PATCH", CONV, {"name": "   "}, SERVICE, 422),
    "rename-direction-override": ("PATCH", CONV, {"name": "Invoice \u202efdp.exe"}, SERVICE, 422),
    "rename-missing": ("PATCH", "/v1/conversations/missing", {"name": "x"}, SERVICE, 404),
    "rename-not-json": ("PATCH", CONV, b"{nope", JSON_BODY, 400),
    "rename-deep": ("PATCH", CONV, b'{"name": ' + b"[" * 5000 + b"]" * 5000 + b"}", JSON_BODY, 400),
    "rename-text": ("PATCH", CONV, b"x", SERVICE | {"Content-Type": "text/plain"}, 415),
    "rename-too-large": ("PATCH", CONV, {"name": "x" * 2_000_000}, SERVICE, 413),
    "fork-legacy-only": (
        "POST",
        f"/v1/conversations/{LEGACY_ONLY}/forks",
        {"at_seq": 0, "new_conversation_id": "conv-legacy-fork"},
        SERVICE,
        409,
    ),
    "delete-legacy-only": ("DELETE", f"/v1/conversations/{LEGACY_ONLY}", None, SERVICE, 200),
    "delete-missing": ("DELETE", "/v1/conversations/missing", None, SERVICE, 404),
    "transcript": ("GET", f"{CONV}/transcript", None, SERVICE, 200),
    "transcript-missing": ("GET", "/v1/conversations/missing/transcript", None, SERVICE, 404),
    "messages-bad-after": ("GET", f"{CONV}/messages?after=nope", None, SERVICE, 422),
    "log-turn": ("POST", "/v1/conversations/conv-new/turns", TURN, SERVICE, 201),
    "log-turn-again": ("POST", f"{CONV}/turns", TURN | {"turn_id": "t1"}, SERVICE, 201),
    "log-turn-for-another-user": (
        "POST",
        "/v1/conversations/conv-new/turns",
        TURN | {"user_id": OWNER},
        auth_headers(user=OTHER),
        403,
    ),
    "log-turn-huge-integer": (
        "POST",
        f"{CONV}/turns",
        {"messages": [{"role": "assistant", "content": "x", "latency_ms": 2**63}]},
        SERVICE,
        422,
    ),
    "log-turn-spaces-name": ("POST", f"{CONV}/turns", TURN | {"name": " \t "}, SERVICE, 422),
    "pending-hitl": ("GET", HITL, None, SERVICE, 200),
    "resolve-wrong-prompt": ("POST", f"{HITL}/resolve", {"request_id": "nope"}, SERVICE, 409),
    "resolve-missing": (
        "POST",
        "/v1/conversations/missing/hitl/resolve",
        {"request_id": "r"},
        SERVICE,
        404,
    ),
    "search-negated": ("GET", f"/v1/search?q=-a%20-b&user_id={OWNER}", None, SERVICE, 422),
    "search-of-another-user": (
        "GET",
        f"/v1/search?q=a&user_id={OWNER}",
        None,
        auth_headers(user=OTHER),
        403,
    ),
    "export": ("GET", f"/v1/users/{OWNER}/export", None, SERVICE, 200),
    "export-of-another-user": (
        "GET",
        f"/v1/users/{OWNER}/export",
        None,
        auth_headers(user=OTHER),
        403,
    ),
    "erase": ("DELETE", f"/v1/users/{OWNER}", None, SERVICE, 200),
    "erase-of-another-user": ("DELETE", f"/v1/users/{OWNER}", None, auth_headers(user=OTHER), 403),
    "claim": ("POST", "/v1/claims", {"from_user_id": OTHER, "to_user_id": "u2"}, SERVICE, 200),
    "claim-by-a-user": (
        "POST",
        "/v1/claims",
        {"from_user_id": OTHER, "to_user_id": "u2"},
        auth_headers(user=OTHER),
        403,
    ),
    "claim-to-self": (
        "POST",
        "/v1/claims",
        {"from_user_id": OTHER, "to_user_id": OTHER},
        SERVICE,
        422,
    ),
}


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db()) as served:
        await served.db[LEGACY_TURNS].insert_one(
            {"conversation_id": LEGACY_ONLY, "user_id": OWNER, "user_message": "Old times"}
        )
        yield served


def operation_of(document: dict[str, Any], method: str, url: str) -> dict[str, Any]:
    path = url.partition("?")[0]
    for template, item in document["paths"].items():
        if re.fullmatch(re.sub(r"{\w+}", "[^/]+", template), path) and method.lower() in item:
            operation: dict[str, Any] = item[method.lower()]
            return operation
    raise AssertionError(f"{method} {path} is not in the document")


@pytest.mark.parametrize("case", list(CASES))
async def test_every_status_a_route_gives_is_documented(api: Served, case: str) -> None:
    method, url, body, headers, expected = CASES[case]
    document = (await api.http.get("/openapi.json", headers=SERVICE)).json()
    if isinstance(body, bytes):
        response = await api.http.request(method, url, content=body, headers=headers)
    else:
        response = await api.http.request(method, url, json=body, headers=headers)
    assert response.status_code == expected, response.text[:300]
    if url == "/health":
        return
    operation = operation_of(document, method, url)
    assert str(expected) in operation["responses"], f"{expected} is not documented for {case}"


def body_schema(document: dict[str, Any], name: str) -> dict[str, Any]:
    """A body model's JSON Schema, with the document's definitions to resolve its refs."""
    schema = dict(document["components"]["schemas"][name])
    schema["components"] = document["components"]  # where its `$ref`s point
    return schema


NAMES = st.text(alphabet=st.characters(codec="utf-8"), max_size=8) | st.sampled_from(
    [
        "   ",
        "\t\n",
        "\u3000",
        "\x1c",
        "\ufeff",
        "\u200b",
        "\u200f",
        "a\u200eb",
        "\u3164 ",
        "\U000e0041",
        "\u2800",
        "a\u200db",
        " a ",
        "\x85",
        "a\u202eb",
        "\x00",
        "b\x9b",
    ]
)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(names=st.lists(NAMES, min_size=1, max_size=10))
async def test_a_name_the_schema_allows_is_a_name_the_service_takes(names: list[str]) -> None:
    async with serve(mongomock_db()) as api:  # one service for several names: seeding costs
        document = (await api.http.get("/openapi.json", headers=SERVICE)).json()
        validator = Draft202012Validator(body_schema(document, "RenameBody"))
        for name in names:
            allowed = validator.is_valid({"name": name})
            response = await api.http.patch(CONV, json={"name": name}, headers=SERVICE)
            assert (response.status_code == 200) == allowed, (repr(name), response.text)
