"""Every route and every kind of caller: another user's data is never returned or changed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from agent_store.store import PENDING_CALLS_KEPT
from tests.api_harness import (
    OTHER,
    OWNER,
    OWNER_CONVERSATION,
    OWNER_HITL_CONVERSATION,
    OWNER_SECRETS,
    SERVICE_TOKEN,
    auth_headers,
    mongomock_db,
    serve,
)
from tests.conftest import Backend

CONV = f"/v1/conversations/{OWNER_CONVERSATION}"
HITL = f"/v1/conversations/{OWNER_HITL_CONVERSATION}/hitl"


@dataclass(frozen=True)
class RouteCase:
    method: str
    url: str
    body: dict[str, Any] | None = None
    mutates: bool = False
    owner_status: int = 200
    """What the owner's user token gets."""
    other_status: int = 404
    """What another user's token gets: hidden (404) or refused (403)."""
    public: bool = False
    """Answers every caller, tokens or none (probes and the API's own documents)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Sent besides the caller's own."""
    service_status: int | None = None
    """What a service gets, when not what the owner gets (or 200 where the owner is refused)."""


ROUTES = {
    "ready": RouteCase("GET", "/ready", public=True),
    "openapi": RouteCase("GET", "/openapi.json", public=True),
    "docs": RouteCase("GET", "/docs", public=True),
    "metrics": RouteCase("GET", "/metrics", public=True),
    "list": RouteCase("GET", f"/v1/users/{OWNER}/conversations", other_status=403),
    "get": RouteCase("GET", CONV),
    "rename": RouteCase("PATCH", CONV, {"name": "Mine now"}, mutates=True),
    "delete": RouteCase("DELETE", CONV, mutates=True),
    "delete-naming-another-conversation": RouteCase(
        "DELETE",
        CONV,
        headers={"If-Match": '"0123456789abcdef0123456789abcdef"'},
        owner_status=412,
        service_status=412,
    ),
    "transcript": RouteCase("GET", f"{CONV}/transcript"),
    "messages": RouteCase("GET", f"{CONV}/messages?limit=5"),
    "log-turn": RouteCase(
        "POST",
        f"{CONV}/turns",
        {"turn_id": "t-matrix", "messages": [{"role": "user", "content": "hello"}]},
        mutates=True,
        owner_status=201,
    ),
    "pending-hitl": RouteCase("GET", HITL),
    "resolve-hitl": RouteCase("POST", f"{HITL}/resolve", {"request_id": "req-ada"}, mutates=True),
    "export": RouteCase("GET", f"/v1/users/{OWNER}/export", other_status=403),
    "erase": RouteCase("DELETE", f"/v1/users/{OWNER}", mutates=True, other_status=403),
    "claim": RouteCase(
        "POST",
        "/v1/claims",
        {"from_user_id": OWNER, "to_user_id": "user-thief"},
        mutates=True,
        owner_status=403,
        other_status=403,
    ),
}

CALLERS = {
    "no-token": {},
    "wrong-token": {"Authorization": "Bearer not-a-configured-token"},
    "wrong-scheme": {"Authorization": f"Basic {SERVICE_TOKEN}"},
    "service": "service",
    "owner": OWNER,
    "other-user": OTHER,
}


def headers_for(caller: str) -> dict[str, str]:
    if caller == "service":
        return auth_headers()
    if caller in ("owner", "other-user"):
        return auth_headers(user=OWNER if caller == "owner" else OTHER)
    value = CALLERS[caller]
    assert isinstance(value, dict)
    return value


def expected_status(route: RouteCase, caller: str) -> int:
    if route.public:
        return 200
    if caller in ("no-token", "wrong-token", "wrong-scheme"):
        return 401
    if caller == "service":
        if route.service_status is not None:
            return route.service_status
        return 201 if route.owner_status == 201 else 200
    return route.owner_status if caller == "owner" else route.other_status


@pytest.mark.parametrize("caller", list(CALLERS))
@pytest.mark.parametrize("route_name", list(ROUTES))
async def test_route_answers_each_caller_as_authorized(route_name: str, caller: str) -> None:
    route = ROUTES[route_name]
    async with serve(mongomock_db()) as api:
        before = await api.digest()
        response = await api.http.request(
            route.method, route.url, json=route.body, headers=headers_for(caller) | route.headers
        )
        expected = expected_status(route, caller)
        assert response.status_code == expected, response.text
        changed = await api.digest() != before
        if expected >= 400:
            assert not changed, f"{caller} was refused but data changed"
            assert set(response.json()) == {"error"}
        else:
            assert changed == route.mutates
        if caller != "owner" and caller != "service":
            for secret in OWNER_SECRETS:
                assert secret not in response.text


async def test_health_answers_every_caller() -> None:
    async with serve(mongomock_db()) as api:
        for caller in CALLERS:
            assert (await api.http.get("/health", headers=headers_for(caller))).status_code == 200


@pytest.mark.parametrize("header", ["Authorization", "X-User-JWT"])
async def test_a_credential_header_sent_twice_is_refused_whichever_comes_first(
    header: str,
) -> None:
    """Which of two values a proxy in between would pick is not known: neither is used."""
    own, other = auth_headers(user=OWNER), auth_headers(user=OTHER)
    async with serve(mongomock_db()) as api:
        for first, second in ((own, other), (other, own)):
            sent = [(k, v) for k, v in first.items()] + [(header, second[header])]
            response = await api.http.get(CONV, headers=sent)
            assert response.status_code == 401, response.text
            assert f"{header.lower()} header is sent 2 times" in response.json()["error"]["message"]


async def test_a_user_token_lists_and_exports_only_its_own_conversations() -> None:
    async with serve(mongomock_db()) as api:
        own = await api.http.get(
            f"/v1/users/{OTHER}/conversations", headers=auth_headers(user=OTHER)
        )
        assert {c["user_id"] for c in own.json()["data"]} == {OTHER}
        exported = await api.http.get(f"/v1/users/{OTHER}/export", headers=auth_headers(user=OTHER))
        assert exported.status_code == 200
        for secret in OWNER_SECRETS:
            assert secret not in exported.text


async def test_a_user_token_cannot_log_a_turn_for_another_user() -> None:
    async with serve(mongomock_db()) as api:
        before = await api.digest()
        response = await api.http.post(
            "/v1/conversations/conv-brand-new/turns",
            json={"user_id": OWNER, "messages": [{"role": "user", "content": "hi"}]},
            headers=auth_headers(user=OTHER),
        )
        assert response.status_code == 403
        assert await api.digest() == before


def _holding_every_kept_call(tag: str) -> list[dict[str, Any]]:
    """A turn making as many calls as `pending_calls` keeps, the first held by its prompt
    (`<tag>-prompt`): a later turn making a call would push it off (409)."""
    calls = [
        {"id": f"{tag}-call-{i}", "type": "function",
         "function": {"name": "lookup", "arguments": "{}"}}
        for i in range(PENDING_CALLS_KEPT)
    ]  # fmt: skip
    prompt = {
        "action": "confirm",
        "request_id": f"{tag}-prompt",
        "tool_call_ids": [f"{tag}-call-0"],
    }
    return [
        {"role": "user", "content": f"{tag}?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "assistant", "content": None, "hitl_action": prompt},
    ]


@pytest.mark.parametrize(
    ("started_by", "if_match"),
    [pytest.param(OTHER, False, id="another-user"), pytest.param(None, True, id="unowned")],
)
async def test_a_refused_turn_never_names_a_conversation_started_under_its_id_meanwhile(
    started_by: str | None, if_match: bool
) -> None:
    """API.md: to a user token another user's conversation is missing. A user's turn her own
    conversation refuses (409: it would push off a call her prompt holds), the conversation
    deleted (her other tab) and started again by another user (or a service, unowned) between
    the store's read-back and the refusal: 404 `not_found`, naming nothing of the new
    conversation (was: 409 naming its prompt and call), with `If-Match` or without."""
    from tests.test_reliability import RacedOnce

    async with serve(mongomock_db(), seeded=False) as api:
        mine, url = auth_headers(user=OWNER), "/v1/conversations/X/turns"
        first = {"messages": _holding_every_kept_call("owner"), "turn_id": "t1"}
        assert (await api.http.post(url, json=first, headers=mine)).status_code == 201
        headers = dict(mine)
        if if_match:
            headers["If-Match"] = (await api.http.get(url[:-6], headers=mine)).headers["etag"]
        theirs = auth_headers(user=started_by) if started_by else auth_headers()

        async def deleted_and_started_again() -> None:
            assert (await api.http.delete(url[:-6], headers=mine)).status_code == 200
            started = {"messages": _holding_every_kept_call("theirs"), "turn_id": "t1"}
            assert (await api.http.post(url, json=started, headers=theirs)).status_code == 201

        async def nothing() -> None:
            return None

        logger = api.store.logger
        logger._conversations = raced = RacedOnce(
            logger._conversations, nothing, nothing, read_back=deleted_and_started_again
        )
        call = {
            "id": "c-new",
            "type": "function",
            "function": {"name": "lookup", "arguments": "{}"},
        }
        turn = [{"role": "user", "content": "more"}, {"role": "assistant", "tool_calls": [call]}]
        answer = await api.http.post(url, json={"messages": turn, "turn_id": "t2"}, headers=headers)

        assert raced.raced
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "not_found"
        assert "theirs" not in answer.text


async def test_a_user_token_cannot_page_another_users_messages_with_a_cursor() -> None:
    async with serve(mongomock_db()) as api:
        first = await api.http.get(f"{CONV}/messages?limit=2", headers=auth_headers())
        after = first.json()["last_id"]
        response = await api.http.get(
            f"{CONV}/messages", params={"after": after}, headers=auth_headers(user=OTHER)
        )
        assert 400 <= response.status_code < 500
        for secret in OWNER_SECRETS:
            assert secret not in response.text


@pytest.mark.parametrize("caller", list(CALLERS))
async def test_search_answers_each_caller_as_authorized(backend: Backend, caller: str) -> None:
    backend.skip_if_lacking("text_search")
    async with serve(backend.db) as api:
        response = await api.http.get(
            "/v1/search", params={"q": "Paris", "user_id": OWNER}, headers=headers_for(caller)
        )
        expected = {"service": 200, "owner": 200, "other-user": 403}.get(caller, 401)
        assert response.status_code == expected
        if expected == 200:
            assert response.json()["data"]
        # Scoped to a conversation only, another user's token still searches its own data.
        scoped = await api.http.get(
            "/v1/search",
            params={"q": "Paris", "conversation_id": OWNER_CONVERSATION},
            headers=headers_for(caller),
        )
        if caller == "other-user":
            assert scoped.status_code == 200
            assert scoped.json()["data"] == []
        for secret in OWNER_SECRETS if caller not in ("owner", "service") else ():
            assert secret not in response.text + scoped.text
