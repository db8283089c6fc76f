"""The viewer's pages through an in-process client: sign-in, sessions, rendering, escaping."""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from markupsafe import escape

from agent_store import ConversationStore, UserMessage
from agent_store.store import HIDDEN_CHARACTERS
from app.auth import Authenticator
from app.presentation import (
    PRETTY_DEPTH,
    hidden_shown,
    legacy_turn_view,
    message_views,
    pretty_json,
    shown_bytes,
    view_bytes,
    within_page,
)
from app.sessions import SESSION_COOKIE, SESSION_SECONDS, issue_session, session_service
from app.throttle import SignInLimiter
from tests.api_harness import (
    OWNER,
    OWNER_CONVERSATION,
    SERVICE_TOKEN,
    Served,
    api_settings,
    mongomock_db,
    serve,
)


@pytest.fixture
async def api() -> AsyncIterator[Served]:
    async with serve(mongomock_db()) as served:
        yield served


SAME_ORIGIN = {"Origin": "http://test"}


async def sign_in(http: httpx.AsyncClient, token: str = SERVICE_TOKEN) -> httpx.Response:
    return await http.post("/viewer/login", data={"token": token}, headers=SAME_ORIGIN)


async def test_pages_redirect_to_the_sign_in_form_without_a_session(api: Served) -> None:
    for url in ("/viewer", f"/viewer/users/{OWNER}", f"/viewer/conversations/{OWNER_CONVERSATION}"):
        response = await api.http.get(url)
        assert (response.status_code, response.headers["location"]) == (303, "/viewer/login")
    form = await api.http.get("/viewer/login")
    assert 'type="password"' in form.text


async def test_signing_in_sets_a_strict_httponly_cookie_that_holds_no_token(api: Served) -> None:
    response = await sign_in(api.http)
    assert (response.status_code, response.headers["location"]) == (303, "/viewer")
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie
    assert "Path=/viewer" in cookie
    assert SERVICE_TOKEN not in cookie
    page = await api.http.get("/viewer")
    assert page.status_code == 200
    assert "Recent conversations" in page.text


async def test_a_wrong_token_does_not_sign_in(api: Served) -> None:
    response = await sign_in(api.http, "wrong")
    assert response.status_code == 401
    assert "not accepted" in response.text
    assert "set-cookie" not in response.headers


async def test_a_sign_in_posted_from_another_site_is_refused(api: Served) -> None:
    response = await api.http.post(
        "/viewer/login", data={"token": SERVICE_TOKEN}, headers={"Origin": "https://evil.example"}
    )
    assert response.status_code == 403
    assert "set-cookie" not in response.headers


async def test_a_token_in_the_url_signs_nobody_in(api: Served) -> None:
    response = await api.http.get(f"/viewer?token={SERVICE_TOKEN}")
    assert response.status_code == 303
    response = await api.http.post(f"/viewer/login?token={SERVICE_TOKEN}", headers=SAME_ORIGIN)
    assert response.status_code == 401


async def test_a_tampered_session_is_ignored(api: Served) -> None:
    await sign_in(api.http)
    value = api.http.cookies[SESSION_COOKIE]
    api.http.cookies.clear()
    last = "1" if value.endswith("0") else "0"
    api.http.cookies.set(SESSION_COOKIE, value[:-1] + last, path="/viewer")
    assert (await api.http.get("/viewer")).status_code == 303


def test_sessions_expire_and_die_with_the_token_that_opened_them() -> None:
    authenticator = Authenticator(api_settings())
    now = time.time()
    cookie = issue_session(authenticator, "admin-ui", now)
    assert session_service(authenticator, cookie, now + 10) == "admin-ui"
    assert session_service(authenticator, cookie, now + SESSION_SECONDS + 1) is None
    rotated = Authenticator(
        api_settings(
            service_tokens=["a-new-token-after-rotation-0123456789"], named_service_tokens={}
        )
    )
    assert session_service(rotated, cookie, now + 10) is None


async def test_the_list_page_shows_the_users_conversations(api: Served) -> None:
    await sign_in(api.http)
    page = await api.http.get(f"/viewer/users/{OWNER}")
    assert page.status_code == 200
    assert page.text.count("data-conversation=") == 3
    assert "What&#39;s the weather in Paris and in Lyon?" in page.text
    assert "awaiting confirm_payment" in page.text
    redirect = await api.http.get("/viewer", params={"user_id": OWNER})
    assert redirect.headers["location"] == f"/viewer/users/{OWNER}"


async def test_the_list_page_names_the_next_free_seq_as_what_it_is_not_a_count(
    api: Served,
) -> None:
    """`message_count` is the `seq` the next message takes: a pop or a retry moved past a lost
    insert leaves it above the messages held, so the page does not call it "Messages"."""
    await sign_in(api.http)
    page = await api.http.get(f"/viewer/users/{OWNER}")
    headers = re.findall(r"<th(?: [^>]*)?>([^<]*)</th>", page.text)
    assert headers == ["Name", "Last message", "Updated", "Turns", "Next seq", ""]


async def test_the_transcript_renders_every_role_as_a_person_reads_it(api: Served) -> None:
    await sign_in(api.http)
    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")
    assert page.status_code == 200
    html = page.text
    for role in ("system", "user", "assistant", "tool"):
        assert f'data-role="{role}"' in html
    expected = [
        "System trigger",
        "Scheduled follow-up: retry the pending booking.",
        "Calls <code>get_weather</code>",
        "&#34;city&#34;: &#34;Paris&#34;",  # arguments, pretty-printed and escaped
        "answers get_weather (call_w1)",
        "&#34;temp_c&#34;: 18",
        "Needs a person: <code>confirm_booking</code>",
        "req-booking-1",
        "Uploaded id-card.pdf",
        "47.1 KiB",
        "ADA LOVELACE 1815-12-10",
        "Booking service unavailable (HTTP 503)",
        "120 tokens in · 31 out · 640 ms",
    ]
    for text in expected:
        assert text in html, text
    assert "RUNTIME CONTEXT" not in html
    assert page.headers["content-security-policy"].startswith("default-src 'none'")


async def test_stored_text_is_escaped_not_run(api: Served) -> None:
    await api.store.logger.log_messages(
        "conv-xss",
        [{"role": "user", "content": "<script>alert('x')</script><img src=x onerror=alert(1)>"}],
        user_id=OWNER,
    )
    await sign_in(api.http)
    for url in ("/viewer/conversations/conv-xss", f"/viewer/users/{OWNER}"):
        html = (await api.http.get(url)).text
        assert "<script>alert" not in html
        assert "<img src=x" not in html
        assert "&lt;script&gt;" in html


async def test_the_legacy_page_shows_old_turns_beside_the_messages(api: Served) -> None:
    await sign_in(api.http)
    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}/legacy")
    assert page.status_code == 200
    assert page.text.count("data-legacy-turn=") == 4
    assert page.text.count("data-role=") == 12
    for text in (
        "Tool call: get_weather",
        "Tool result: search_trains",
        "HITL prompt: confirm_booking [req-booking-1]",
        "Unknown part type &#39;sticker&#39;",
    ):
        assert text in page.text, text


async def test_a_transcript_page_shows_one_conversation_when_its_id_is_started_again_meanwhile(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversation deleted and started again by another user between the page's read of
    the conversation and its read of the messages: the page is one conversation's, the new
    one's whole (its owner and messages), never the deleted one's header over the new one's
    messages."""
    await sign_in(api.http)
    original = ConversationStore.stored_conversation

    async def then_started_again(self: ConversationStore, *args: Any, **kwargs: Any) -> Any:
        read = await original(self, *args, **kwargs)
        monkeypatch.setattr(ConversationStore, "stored_conversation", original)
        await api.store.conversations.delete(OWNER_CONVERSATION)
        said = [{"role": "user", "content": "L2 question"}]
        await api.store.logger.log_messages(OWNER_CONVERSATION, said, user_id="user-grace")
        return read

    monkeypatch.setattr(ConversationStore, "stored_conversation", then_started_again)

    page = await api.http.get(f"/viewer/conversations/{OWNER_CONVERSATION}")

    assert page.status_code == 200
    assert "L2 question" in page.text
    assert "user-grace" in page.text
    assert OWNER not in page.text
    assert "ADA LOVELACE" not in page.text


async def test_a_missing_conversation_is_a_readable_404_page(api: Served) -> None:
    await sign_in(api.http)
    page = await api.http.get("/viewer/conversations/nope")
    assert page.status_code == 404
    assert "was not found" in page.text
    assert page.headers["content-type"].startswith("text/html")


async def test_signing_out_clears_the_session(api: Served) -> None:
    await sign_in(api.http)
    response = await api.http.post("/viewer/logout", headers=SAME_ORIGIN)
    assert response.status_code == 303
    assert (await api.http.get("/viewer")).status_code == 303


def test_legacy_turns_are_read_leniently() -> None:
    view = legacy_turn_view(
        {
            "_id": "t1",
            "is_system": True,
            "response_parts": [
                {"type": "tool_call", "tool_name": "lookup", "args": '{"q": 1}'},
                {"type": "tool_result", "result": {"ok": True}},
                "not a part",
                {"type": "error", "message": "boom"},
                {"type": "file_upload", "filename": "a.txt", "file_type": "text/plain", "size": 3},
            ],
            "mystery": 1,
        }
    )
    assert view.is_system
    assert view.user_message == ""
    assert [p.kind for p in view.parts] == [
        "tool_call",
        "tool_result",
        "unknown",
        "error",
        "file_upload",
    ]
    assert view.parts[0].body == pretty_json({"q": 1})
    assert view.parts[1].title == "Tool result: ?"
    assert view.other_fields == ["mystery"]
    assert legacy_turn_view({}).parts == []


async def test_a_conversation_not_migrated_yet_shows_its_legacy_turns_alone(api: Served) -> None:
    await api.db["agent_conversations_deprecated"].insert_one(
        {"conversation_id": "conv-old", "user_message": "Hello from 2024", "response_parts": []}
    )
    await sign_in(api.http)
    page = await api.http.get("/viewer/conversations/conv-old/legacy")
    assert page.status_code == 200
    assert "Hello from 2024" in page.text
    assert "Not migrated yet" in page.text
    missing = await api.http.get("/viewer/conversations/conv-none/legacy")
    assert missing.status_code == 404


@pytest.mark.parametrize("depth", [50_000, 2_000])
async def test_the_viewer_shows_stored_text_however_deeply_it_nests(
    api: Served, depth: int
) -> None:
    deep = "[" * depth + "]" * depth
    await api.store.logger.log_messages(
        "conv-deep",
        [
            {"role": "user", "content": "Nest it"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "nest", "arguments": deep}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": deep},
        ],
        user_id=OWNER,
    )
    await api.db["agent_conversations_deprecated"].insert_one(
        {
            "conversation_id": "conv-deep",
            "user_message": "Nest it",
            "response_parts": [
                {"type": "tool_call", "tool_name": "nest", "args": deep},
                {"type": "tool_result", "tool_name": "nest", "result": deep},
            ],
        }
    )
    await sign_in(api.http)
    for url in ("/viewer/conversations/conv-deep", "/viewer/conversations/conv-deep/legacy"):
        page = await api.http.get(url)
        assert page.status_code == 200, url
        assert page.text.count(deep) >= 2, url


WIDE = [[0] * 30_000]
for _ in range(PRETTY_DEPTH - 2):
    WIDE = [WIDE]
WIDE_TEXT = json.dumps(WIDE, separators=(",", ":"))
"""30,000 small values nested as deep as the viewer indents (`PRETTY_DEPTH`): indented,
each would take a line of 64 spaces."""


def wide_turn(where: str) -> list[dict[str, Any]]:
    """A turn holding `WIDE` as a call's arguments, a result or a prompt's params."""
    arguments = WIDE_TEXT if where == "arguments" else "{}"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    asked = {"action": "confirm", "request_id": "r1", "params": {"rows": WIDE[0]}}
    prompt = {"role": "assistant", "content": "ok?", "hitl_action": asked}
    return [
        {"role": "user", "content": "wide"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": WIDE_TEXT if where == "result" else "ok"},
        *([prompt] if where == "params" else []),
    ]


@pytest.mark.parametrize("where", ["arguments", "result", "params"])
async def test_a_page_grows_with_what_it_shows_never_with_its_depth_times_its_size(
    api: Served, where: str
) -> None:
    """Indenting gives each value a line of two spaces per level: stored JSON is indented only
    while that keeps it within a few times its stored size (`PRETTY_GROWTH`), else it is shown
    as stored, so a page costs about what its messages weigh (a user's 600 KB of arguments
    nested 32 deep made 20 MB of HTML)."""
    await api.store.logger.log_messages(f"conv-{where}", wide_turn(where), user_id=OWNER)
    await sign_in(api.http)

    page = await api.http.get(f"/viewer/conversations/conv-{where}")

    assert page.status_code == 200
    assert len(page.content) < 2 * len(WIDE_TEXT) + 20_000
    assert re.search(r"0, ?0, ?0, ?0", page.text)  # shown as stored, each row on one line


def test_json_indented_beyond_a_few_times_its_size_is_shown_as_stored() -> None:
    assert pretty_json(WIDE_TEXT) == WIDE_TEXT
    assert pretty_json(WIDE) == json.dumps(WIDE, ensure_ascii=False)
    assert pretty_json("[[[1]]]") == "[\n  [\n    [\n      1\n    ]\n  ]\n]"  # a small text


# -- sessions on the server, sign-in limits, origins -----------------------------------------


async def test_signing_out_revokes_the_session_on_the_server(api: Served) -> None:
    await sign_in(api.http)
    kept = api.http.cookies[SESSION_COOKIE]
    assert (await api.http.get("/viewer")).status_code == 200
    await api.http.post("/viewer/logout", headers=SAME_ORIGIN)
    # A copy of the cookie taken before signing out (a stolen one, say) opens nothing.
    api.http.cookies.set(SESSION_COOKIE, kept, path="/viewer")
    response = await api.http.get("/viewer")
    assert (response.status_code, response.headers["location"]) == (303, "/viewer/login")


async def test_sessions_of_other_sign_ins_survive_a_sign_out(api: Served) -> None:
    await sign_in(api.http)
    other = api.http.cookies[SESSION_COOKIE]
    api.http.cookies.clear()
    await sign_in(api.http)
    await api.http.post("/viewer/logout", headers=SAME_ORIGIN)
    api.http.cookies.set(SESSION_COOKIE, other, path="/viewer")
    assert (await api.http.get("/viewer")).status_code == 200


def client_at(api: Served, address: str) -> httpx.AsyncClient:
    app = api.http._transport.app  # type: ignore[attr-defined]
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


async def test_sign_in_attempts_are_limited_per_client(api: Served) -> None:
    limiter: SignInLimiter = api.http._transport.app.state.sign_in_limiter  # type: ignore[attr-defined]
    now = [1000.0]
    limiter.clock = lambda: now[0]
    async with client_at(api, "203.0.113.7") as attacker, client_at(api, "198.51.100.2") as other:
        for attempt in range(limiter.max_failures):
            wrong = await sign_in(attacker, f"wrong-token-number-{attempt:02d}-0123456789abcdef")
            assert wrong.status_code == 401
        refused = await sign_in(attacker)  # even the right token, until the window passes
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) > 0
        assert "set-cookie" not in refused.headers
        assert (await sign_in(other)).status_code == 303  # another client is not held up
        now[0] += limiter.window_seconds + 1
        assert (await sign_in(attacker)).status_code == 303


def test_the_sign_in_limiter_forgets_the_oldest_clients_beyond_its_capacity() -> None:
    limiter = SignInLimiter(max_failures=2, window_seconds=60, max_clients=3)
    limiter.clock = lambda: 0.0
    for client in ("a", "b", "c", "d"):
        limiter.failed(client)
        limiter.failed(client)
    assert limiter.retry_after("d") > 0
    assert limiter.retry_after("a") == 0
    assert len(limiter) == 3


async def test_sign_ins_whose_forms_arrive_late_are_limited_all_the_same(api: Served) -> None:
    """Every post is past the door before any form arrives: the ones in flight count."""
    limiter: SignInLimiter = api.http._transport.app.state.sign_in_limiter  # type: ignore[attr-defined]
    gate = asyncio.Event()
    reading: set[int] = set()
    attempts = range(3 * limiter.max_failures)
    settled = [asyncio.Event() for _ in attempts]  # answered, or waiting for its form

    async def late_form(attempt: int) -> AsyncIterator[bytes]:
        reading.add(attempt)
        settled[attempt].set()
        await gate.wait()
        yield f"token=wrong-token-number-{attempt:02d}-0123456789abcdef".encode()

    headers = {**SAME_ORIGIN, "Content-Type": "application/x-www-form-urlencoded"}
    async with client_at(api, "203.0.113.7") as attacker:

        async def post(attempt: int) -> httpx.Response:
            try:
                return await attacker.post(
                    "/viewer/login", content=late_form(attempt), headers=headers
                )
            finally:
                settled[attempt].set()

        posts = [asyncio.create_task(post(attempt)) for attempt in attempts]
        async with asyncio.timeout(10):
            await asyncio.gather(*(event.wait() for event in settled))
        gate.set()
        answers = Counter(response.status_code for response in await asyncio.gather(*posts))
        assert answers == {401: limiter.max_failures, 429: 2 * limiter.max_failures}
        assert len(reading) == limiter.max_failures  # the refused ones were never read
        assert (await sign_in(attacker)).status_code == 429  # the right token included


async def test_a_sign_in_abandoned_before_its_form_arrives_gives_its_attempt_back(
    api: Served,
) -> None:
    app = api.http._transport.app  # type: ignore[attr-defined]
    limiter: SignInLimiter = app.state.sign_in_limiter
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/viewer/login",
        "raw_path": b"/viewer/login",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"origin", b"http://test")],
        "client": ("203.0.113.7", 40000),
        "server": ("test", 80),
    }

    async def hang_up() -> dict[str, str]:
        return {"type": "http.disconnect"}

    async def send(message: object) -> None:
        pass

    for _ in range(limiter.max_failures):
        await app(dict(scope), hang_up, send)
    assert limiter.retry_after("203.0.113.7") == 0
    async with client_at(api, "203.0.113.7") as browser:
        assert (await sign_in(browser)).status_code == 303


def test_the_sign_in_limiter_counts_attempts_in_flight_against_the_limit() -> None:
    limiter = SignInLimiter(max_failures=3, window_seconds=60)
    limiter.clock = lambda: 0.0
    assert [limiter.reserve("a") for _ in range(4)] == [0, 0, 0, 1]  # three held, the fourth waits
    assert limiter.retry_after("a") == 1
    assert limiter.reserve("b") == 0  # another client is not held up
    limiter.failed("a")
    limiter.release("a")
    limiter.release("a")  # given up before its token was checked: not a failure
    assert limiter.reserve("a") == 0  # one failure, two in flight
    assert limiter.reserve("a") == 1
    limiter.failed("a")
    limiter.release("a")
    limiter.succeeded("a")  # the right token, in flight alongside: a fresh start
    limiter.release("a")
    assert [limiter.reserve("a") for _ in range(4)] == [0, 0, 0, 1]
    for _ in range(3):
        limiter.failed("a")
        limiter.release("a")
    assert limiter.reserve("a") == 60  # three failures: the oldest leaves the window in 60 s


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        pytest.param({}, 403, id="neither-origin-nor-referer"),
        pytest.param({"Origin": "null"}, 403, id="null-origin"),
        pytest.param({"Origin": "http://test.evil.example"}, 403, id="lookalike-origin"),
        pytest.param({"Referer": "https://evil.example/viewer/login"}, 403, id="foreign-referer"),
        pytest.param({"Referer": "http://test/viewer/login"}, 303, id="own-referer"),
        pytest.param({"Origin": "http://test"}, 303, id="own-origin"),
    ],
)
async def test_a_sign_in_must_come_from_this_sites_own_form(
    api: Served, headers: dict[str, str], status: int
) -> None:
    response = await api.http.post("/viewer/login", data={"token": SERVICE_TOKEN}, headers=headers)
    assert response.status_code == status
    assert ("set-cookie" in response.headers) == (status == 303)


async def test_a_sign_out_from_another_site_is_refused(api: Served) -> None:
    await sign_in(api.http)
    response = await api.http.post("/viewer/logout", headers={"Origin": "https://evil.example"})
    assert response.status_code == 403
    assert (await api.http.get("/viewer")).status_code == 200


# -- showing what the store holds, as it holds it --------------------------------------------


def prompt_turn(n: int, request_id: str) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": f"pay invoice {n}"},
        {
            "role": "assistant",
            "content": f"Shall I pay invoice {n}?",
            "hitl_action": {"action": f"confirm_payment_{n}", "request_id": request_id},
        },
    ]


async def test_each_prompt_shows_the_status_the_store_gives_it(api: Served) -> None:
    """A runtime may ask a request id again once it is answered: only the prompt the
    conversation holds pending (`pending_hitl`, by its message) is pending; the earlier one
    of the same id stays resolved."""
    store = api.store
    await store.logger.log_messages("conv-ask", prompt_turn(1, "confirm-1"), user_id=OWNER)
    await store.conversations.resolve_hitl("conv-ask", "confirm-1")
    await store.logger.log_messages("conv-ask", prompt_turn(2, "confirm-1"), user_id=OWNER)
    await sign_in(api.http)
    page = await api.http.get("/viewer/conversations/conv-ask")
    badges = re.findall(
        r'Needs a person: <code>(\w+)</code></span>\s*<span class="badge \w+">(\w+)</span>',
        page.text,
    )
    assert badges == [("confirm_payment_1", "resolved"), ("confirm_payment_2", "pending")]


def tool_turn(n: int, tool: str, call_id: str = "call_0") -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": "{}"}}
    return [
        {"role": "user", "content": f"step {n}"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": f"result of {tool}"},
    ]


async def test_a_tool_result_names_the_call_it_answers_when_ids_repeat(api: Served) -> None:
    """Providers numbering calls per response reuse `call_0` every turn: each result answers
    the call the store pairs it with (`answers_to_calls`), not the page's last of that id."""
    for n, tool in enumerate(("read_balance", "wire_money")):
        await api.store.logger.log_messages("conv-ids", tool_turn(n, tool), user_id=OWNER)
    await sign_in(api.http)
    page = await api.http.get("/viewer/conversations/conv-ids")
    shown = re.findall(
        r'<span class="answers">answers ([^<]+)</span>.*?<pre class="result">([^<]*)</pre>',
        page.text,
        re.S,
    )
    assert shown == [
        ("read_balance (call_0)", "result of read_balance"),
        ("wire_money (call_0)", "result of wire_money"),
    ]


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param('{"iban": "DE00 1111", "iban": "GB99 6666"}', id="a-repeated-key"),
        pytest.param('[{"a": 1, "a": 2}]', id="a-repeated-key-inside"),
        pytest.param('{"amount": 1e400}', id="a-number-past-a-double"),
        pytest.param('{"fee": 0.30000000000000000001}', id="more-digits-than-a-double"),
        pytest.param('{"n": -0}', id="minus-zero"),
        pytest.param('{"n": 1E5}', id="an-exponent"),
        pytest.param('{"n": 1.50}', id="a-trailing-zero"),
        pytest.param('{"arguments": "\\ud800"}', id="an-escaped-lone-surrogate"),
        pytest.param('{"attachment": "\\u202egpj.exe"}', id="an-escaped-direction-override"),
        pytest.param('{"to": "\\u0041lice", "path": "a\\/b"}', id="escapes-of-plain-characters"),
    ],
)
def test_json_text_is_indented_changing_nothing_but_its_white_space(stored: str) -> None:
    """Parsed and written again, it would lose a repeated key, write a number otherwise
    (1e400 as Infinity, 0.30000000000000000001 as 0.3) or a string otherwise (an escape as
    the character it stands for: a lone surrogate no page can hold, a hidden direction
    override): it is indented token by token instead, every token as stored."""
    shown = pretty_json(stored)
    assert "\n  " in shown
    assert same_but_white_space(shown, stored)


def same_but_white_space(shown: str, stored: str) -> bool:
    """Whether `shown` is `stored` with only white space between tokens changed."""
    literals = re.findall(r'"(?:[^"\\]|\\.)*"', stored)
    return "".join(shown.split()) == "".join(stored.split()) and literals == re.findall(
        r'"(?:[^"\\]|\\.)*"', shown
    )


def test_json_is_indented_when_that_changes_none_of_its_values() -> None:
    stored = '{"a": 1.5, "b": [1, -2, 0.1, 12345678901234567890123], "c": "x", "d": null}'
    assert pretty_json(stored) == (
        '{\n  "a": 1.5,\n  "b": [\n    1,\n    -2,\n    0.1,\n    12345678901234567890123\n  ],'
        '\n  "c": "x",\n  "d": null\n}'
    )


async def log_call_and_result(
    api: Served, conversation_id: str, tool: str, arguments: str, result: str
) -> None:
    """The owner asks, the assistant calls `tool` with `arguments`, and `result` answers it."""
    call = {"id": "c1", "type": "function", "function": {"name": tool, "arguments": arguments}}
    await api.store.logger.log_messages(
        conversation_id,
        [
            {"role": "user", "content": f"{tool} it"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
        ],
        user_id=OWNER,
    )


async def test_a_result_holding_an_escaped_lone_surrogate_is_shown_as_stored(
    api: Served,
) -> None:
    """JSON text may escape a lone surrogate (JavaScript's `JSON.stringify` writes one so):
    the pages that show it, the transcript's and the legacy turns', show the escape, as a
    direction override's, never the character."""
    escaped = '{"note": "\\ud800", "to": "\\u202egpj.exe"}'
    await log_call_and_result(api, "conv-escaped", "note", escaped, escaped)
    await api.db["agent_conversations_deprecated"].insert_one(
        {
            "conversation_id": "conv-escaped-old",
            "user_message": "note it",
            "response_parts": [
                {
                    "part_kind": "tool-call",
                    "tool_name": "note",
                    "tool_call_id": "c1",
                    "args": escaped,
                },
                {
                    "part_kind": "tool-return",
                    "tool_name": "note",
                    "tool_call_id": "c1",
                    "content": escaped,
                },
            ],
        }
    )
    await sign_in(api.http)
    for path in (
        "/viewer/conversations/conv-escaped",
        "/viewer/conversations/conv-escaped-old",  # the legacy turns, read as messages
        "/viewer/conversations/conv-escaped-old/legacy",
    ):
        page = await api.http.get(path)
        assert page.status_code == 200, path
        shown = [html.unescape(p) for p in re.findall(r"<pre[^>]*>(.*?)</pre>", page.text, re.S)]
        assert any(same_but_white_space(text, escaped) for text in shown), path
        assert "\u202e" not in page.text, path


async def test_tool_arguments_and_results_are_shown_as_stored(api: Served) -> None:
    arguments = (
        '{"iban": "DE00 1111", "iban": "GB99 6666", "amount": 1e400, "fee": 0.30000000000000000001}'
    )
    result = '{"balance": 1e400, "balance": 2}'
    await log_call_and_result(api, "conv-pay", "pay", arguments, result)
    await sign_in(api.http)
    page = await api.http.get("/viewer/conversations/conv-pay")
    shown = [html.unescape(p) for p in re.findall(r"<pre[^>]*>(.*?)</pre>", page.text, re.S)]
    assert any(same_but_white_space(text, arguments) for text in shown)
    assert any(same_but_white_space(text, result) for text in shown)


# -- characters that make a line show other than it reads ------------------------------------

RLO = "\u202e"
"""RIGHT-TO-LEFT OVERRIDE: "ACME \u202e0021 EUR" shows as "ACME RUE 1200"."""
HIDDEN_PAGE_CHARACTER = re.compile(f"[{re.escape(HIDDEN_CHARACTERS)}]")


def hidden_in_every_field() -> list[dict[str, Any]]:
    """A turn holding a direction override (and a control, a mark, an isolate) in every text
    a page shows: contents, an upload, a tool's name and arguments, a result, an error, a
    prompt's action and params."""
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": f"pay{RLO}", "arguments": f'{{"to": "ACME {RLO}0021 EUR"}}'},
    }
    upload = {"filename": f"invoice{RLO}fdp.exe", "file_type": f"application/pdf{RLO}", "size": 3}
    asked = {
        "action": f"confirm{RLO}",
        "request_id": "r1",
        "params": {"payee": f"ACME {RLO}0021 EUR", "memo": "\x1b[2J\u200f\u2066x\u2069"},
    }
    return [
        {"role": "system", "content": f"trigger {RLO}yad"},
        {"role": "user", "content": f"pay {RLO}EMCA", "upload": upload | {"parsed_text": RLO}},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": f"paid {RLO}0021"},
        {"role": "assistant", "content": "failed", "error": {"message": f"no {RLO}yenom"}},
        {"role": "assistant", "content": "Confirm?", "hitl_action": asked},
    ]


def legacy_turn_hiding_characters() -> dict[str, Any]:
    return {
        "_id": f"lt{RLO}1",
        "conversation_id": "conv-hidden",
        "user_id": OWNER,
        "name": f"old {RLO}eman",
        "user_message": f"pay {RLO}EMCA",
        "upload_result": {"filename": f"invoice{RLO}fdp.exe", "file_type": "pdf", "size": 3},
        "response_parts": [
            {"type": "tool_call", "tool_name": f"pay{RLO}", "args": {"to": f"ACME {RLO}0021"}},
            {"type": "hitl", "action": f"confirm{RLO}", "request_id": "r1", "params": {"a": RLO}},
            {"type": f"sticker{RLO}", "x": RLO},
        ],
    }


async def test_no_page_shows_a_hidden_character_as_itself_only_as_its_escape(api: Served) -> None:
    """A direction override, an isolate, a mark or a control in any text a page prints
    (`HIDDEN_CHARACTERS`) is shown as its JSON escape (`\\u202e`), never obeyed: the params a
    person confirms, a prompt's action on the lists, a file's name, a tool's, an error,
    a result, legacy turns, as arguments' escapes are shown as written."""
    await api.store.logger.log_messages("conv-hidden", hidden_in_every_field(), user_id=OWNER)
    await api.db["agent_conversations_deprecated"].insert_one(legacy_turn_hiding_characters())
    await sign_in(api.http)
    pages = {}
    for path in (
        "/viewer",
        f"/viewer/users/{OWNER}",
        "/viewer/conversations/conv-hidden",
        "/viewer/conversations/conv-hidden/legacy",
    ):
        page = await api.http.get(path)
        assert page.status_code == 200, path
        assert not HIDDEN_PAGE_CHARACTER.search(page.text), path
        pages[path] = html.unescape(page.text)

    escaped = "\\u202e"
    transcript = pages["/viewer/conversations/conv-hidden"]
    for shown in (
        f'"payee": "ACME {escaped}0021 EUR"',
        '"memo": "\\u001b[2J\\u200f\\u2066x\\u2069"',
        f'"to": "ACME {escaped}0021 EUR"',
        f"Uploaded invoice{escaped}fdp.exe",
        f"application/pdf{escaped}, 3 bytes",
        f"Calls <code>pay{escaped}</code>",
        f"answers pay{escaped} (c1)",
        f"paid {escaped}0021",
        f"no {escaped}yenom",
        f"Needs a person: <code>confirm{escaped}</code>",
        f"Waiting for a person: <code>confirm{escaped}</code>",
        f"trigger {escaped}yad",
    ):
        assert shown in transcript, shown
    for path in ("/viewer", f"/viewer/users/{OWNER}"):
        assert f"awaiting confirm{escaped}" in pages[path], path
    legacy = pages["/viewer/conversations/conv-hidden/legacy"]
    for shown in (f"name: old {escaped}eman", f"Tool call: pay{escaped}", f'"a": "{escaped}"'):
        assert shown in legacy, shown


@pytest.mark.parametrize("character", list(HIDDEN_CHARACTERS), ids=lambda c: f"U+{ord(c):04X}")
def test_each_hidden_character_is_shown_as_its_escape(character: str) -> None:
    assert hidden_shown(f"a{character}b") == f"a\\u{ord(character):04x}b"


def test_text_without_hidden_characters_is_shown_as_it_is() -> None:
    text = "line one\n\ttab, שלום, مرحبا, 😀, \\u202e as written, \x85 \u2028"
    assert hidden_shown(text) == text


def test_hidden_characters_are_shown_as_the_escapes_they_were_always_shown_as() -> None:
    """`hidden_shown` writes every hidden character in one pass: the page reads exactly as when
    each was escaped one at a time (the rule written out below), for each character alone
    and for a text mixing them with every other kind of character."""

    def escaped_one_by_one(text: str) -> str:
        one = re.compile(f"[{re.escape(HIDDEN_CHARACTERS)}]")
        return one.sub(lambda hidden: f"\\u{ord(hidden.group()):04x}", text)

    mixed = "".join(f"{c}x\n\t\u00e9\U0001f600\\u0001" for c in HIDDEN_CHARACTERS) * 3
    for text in (*HIDDEN_CHARACTERS, HIDDEN_CHARACTERS, mixed, "\x01" * 1000, ""):
        assert hidden_shown(text) == escaped_one_by_one(text)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "plain [1, 2] {\"a\": 'b'} & <i>",
        "\u00e9\U0001f600 \u2028 \x85 \ud800 \n\t\u2026 <&>",
        "[[],[]]" * 1000 + "\u2026",
        HIDDEN_CHARACTERS + "<&>\u00e9",
    ],
    ids=["empty", "ascii", "unicode", "json-cut", "hidden"],
)
def test_the_bytes_a_page_prints_of_a_text_are_those_of_the_text_it_prints(text: str) -> None:
    """`shown_bytes` counts a text without hidden characters from its escapes' counts (no
    Python step per character of a text that is not ASCII): the same count as the text
    printed, hidden characters escaped and markup escaped, in UTF-8."""
    printed = str(escape(hidden_shown(text)))
    assert shown_bytes(text) == len(printed.encode("utf-8", "surrogatepass"))


def test_a_page_takes_views_while_they_fit_and_cuts_a_first_one_larger_than_it() -> None:
    """`within_page` counts what the views print (a control as its six-character escape): it
    stops before the view that would pass the page, and cuts a first view larger than the
    page alone so that it prints within it, saying how much it prints whole."""
    messages = [UserMessage(content="\x01" * 1000, seq=n) for n in range(5)]
    shown, more = within_page(message_views(messages), 13_000)
    assert ([view.seq for view in shown], more) == ([0, 1], True)
    assert all(view.printed_whole is None for view in shown)
    (alone,), more = within_page(message_views(messages[:1]), 3_000)
    assert not more
    assert alone.content is not None
    assert alone.content.endswith("…")
    assert view_bytes(alone) <= 3_000 < 6_000 < (alone.printed_whole or 0)
    assert (alone.role, alone.label) == ("user", "User")  # short texts stay whole
