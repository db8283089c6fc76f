"""What the service writes to its log and to every response's headers, whatever the request."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.api_harness import (
    OWNER,
    OWNER_CONVERSATION,
    Served,
    auth_headers,
    mongomock_db,
    serve,
)

SERVICE = auth_headers()
CONV = f"/v1/conversations/{OWNER_CONVERSATION}"
HOSTILE = "<script>alert(1)</script>"


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db()) as served:
        yield served


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "agent_store.audit"]


REQUESTS = [
    pytest.param("GET", "/health", {}, id="health"),
    pytest.param("GET", CONV, SERVICE, id="ok"),
    pytest.param("GET", "/openapi.json", SERVICE, id="openapi"),
    pytest.param("GET", f"/v1/users/{OWNER}/export", SERVICE, id="streamed"),
    pytest.param("GET", CONV, {}, id="unauthorized"),
    pytest.param("GET", "/nowhere", SERVICE, id="no-route"),
    pytest.param("PUT", CONV, SERVICE, id="wrong-method"),
    pytest.param("GET", f"{CONV}?limit=x", SERVICE, id="invalid"),
    pytest.param("GET", "/viewer", {}, id="viewer-redirect"),
    pytest.param("GET", "/viewer/login", {}, id="viewer-page"),
    pytest.param("GET", "/viewer/static/viewer.css", {}, id="viewer-static"),
]


@pytest.mark.parametrize(("method", "url", "headers"), REQUESTS)
async def test_every_response_says_nosniff(
    api: Served, method: str, url: str, headers: dict[str, str]
) -> None:
    response = await api.http.request(method, url, headers=headers)
    assert response.headers["x-content-type-options"] == "nosniff"


async def test_an_unexpected_failure_says_nosniff_too(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(api.store.conversations, "get_conversation", broken)
    transport = httpx.ASGITransport(app=api.http._transport.app, raise_app_exceptions=False)  # type: ignore[attr-defined]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.get(CONV, headers=SERVICE)
    assert response.status_code == 500
    assert response.headers["x-content-type-options"] == "nosniff"


REPEATED_CALLS = {
    "role": "assistant",
    "tool_calls": [{"id": HOSTILE, "function": {"name": "f"}}] * 2,
}
ECHOES = [
    pytest.param("GET", f"/{HOSTILE}", {}, None, 404, id="unknown-path"),
    pytest.param("GET", f"{CONV}?{HOSTILE}=1", {}, None, 422, id="unknown-parameter"),
    pytest.param("GET", f"{CONV}/messages?{HOSTILE}=1&{HOSTILE}=2", {}, None, 422, id="repeated"),
    pytest.param("PATCH", CONV, {"Content-Type": f"text/{HOSTILE}"}, b"{}", 415, id="content-type"),
    pytest.param(
        "PATCH",
        CONV,
        {"Content-Type": "application/json"},
        json.dumps({"name": "x", HOSTILE: 1}).encode(),
        422,
        id="body-key",
    ),
    pytest.param(
        "POST",
        f"{CONV}/turns",
        {"Content-Type": "application/json"},
        json.dumps({"messages": [{"role": "user", "content": "x", HOSTILE: 1}]}).encode(),
        422,
        id="message-key",
    ),
    pytest.param(
        "POST",
        f"{CONV}/turns",
        {"Content-Type": "application/json"},
        json.dumps({"messages": [{"role": "user", "content": "x"}, REPEATED_CALLS]}).encode(),
        422,
        id="tool-call-id",
    ),
    pytest.param(
        "POST",
        f"{CONV}/hitl/resolve",
        {"Content-Type": "application/json"},
        json.dumps({"request_id": HOSTILE}).encode(),
        409,
        id="request-id",
    ),
]


@pytest.mark.parametrize(("method", "url", "headers", "body", "status"), ECHOES)
async def test_error_messages_do_not_echo_raw_input(
    api: Served,
    method: str,
    url: str,
    headers: dict[str, str],
    body: bytes | None,
    status: int,
) -> None:
    response = await api.http.request(method, url, headers=SERVICE | headers, content=body)
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert message
    assert "script" not in message


async def test_a_bad_content_length_is_not_echoed(api: Served) -> None:
    headers = SERVICE | {"Content-Type": "application/json"}
    request = api.http.build_request("PATCH", CONV, headers=headers, content=b"{}")
    request.headers["Content-Length"] = "2<b>x</b>"
    response = await api.http.send(request)
    assert response.status_code in (400, 422)
    assert "<b>" not in response.text


async def test_a_wrong_method_is_told_which_methods_the_route_accepts(api: Served) -> None:
    response = await api.http.request("PUT", CONV, headers=SERVICE)
    assert response.status_code == 405
    assert response.json()["error"]["message"] == "this route accepts DELETE, GET, PATCH"


async def test_one_audit_line_per_request_and_none_for_health(
    api: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="agent_store.audit"):
        await api.http.get("/health")
        await api.http.get(
            "/v1/search", params={"q": "-secret -words", "user_id": OWNER}, headers=SERVICE
        )
        await api.http.get(f"{CONV}?token=pasted-by-mistake", headers=SERVICE)
    lines = audit_lines(caplog)
    assert [line["path"] for line in lines] == ["/v1/search", CONV]
    assert "secret" not in caplog.text
    assert "pasted-by-mistake" not in caplog.text


async def test_a_client_hanging_up_before_its_body_is_no_server_error(
    api: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """A runtime's connection dropping mid-request is routine: nothing raised out of the app,
    nothing logged as an error, nothing written."""
    app = api.http._transport.app  # type: ignore[attr-defined]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": f"{CONV}/turns", "raw_path": f"{CONV}/turns".encode(),
        "query_string": b"", "root_path": "", "client": ("203.0.113.7", 40000),
        "server": ("test", 80),
        "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                    *[(k.lower().encode(), v.encode()) for k, v in SERVICE.items()]],
    }  # fmt: skip
    sent: list[dict[str, object]] = []

    async def hang_up() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    before = await api.db.agent_messages.count_documents({})
    with caplog.at_level(logging.INFO):
        await app(scope, hang_up, send)

    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400]
    assert await api.db.agent_messages.count_documents({}) == before
