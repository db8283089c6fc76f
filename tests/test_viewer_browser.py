"""The viewer in a real browser: Debian's headless Chromium against the app served by uvicorn.

Screenshots land in tests/output/. Without /usr/bin/chromium these tests skip
with the reason, except in CI (`CI` set, as `.ci/run` does after installing
Chromium), where they fail: the browser check never silently disappears there.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette

from app.api import create_app
from app.service import Store
from tests.api_harness import (
    OWNER,
    OWNER_CONVERSATION,
    SERVICE_TOKEN,
    api_settings,
    mongomock_db,
    seed,
)

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parent / "output"

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def served_url() -> Iterator[str]:
    settings = api_settings()
    store = Store.on(mongomock_db(), settings)
    asyncio.run(seed(store))  # mongomock-motor is bound to no event loop
    yield from serve_in_thread(create_app(settings, store=store))


def serve_in_thread(app: Starlette) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port, in a thread, until the generator closes."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped while starting"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        missing = (
            "/usr/bin/chromium is missing: install Debian's package "
            "(apt-get install -y chromium; .ci/run does it)"
        )
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield launched
        launched.close()


def test_a_person_signs_in_browses_and_reads_every_role(served_url: str, browser: object) -> None:
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    OUTPUT.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)

    page.goto(f"{served_url}/viewer")
    expect(page).to_have_url(f"{served_url}/viewer/login")
    page.fill("#token", SERVICE_TOKEN)
    page.click("main button[type=submit]")
    expect(page).to_have_url(f"{served_url}/viewer")
    (cookie,) = context.cookies()
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert SERVICE_TOKEN not in cookie["value"]

    page.fill("#user_id", OWNER)
    page.click("main button[type=submit]")
    expect(page).to_have_url(f"{served_url}/viewer/users/{OWNER}")
    expect(page.locator("tr[data-conversation]")).to_have_count(3)
    page.screenshot(path=str(OUTPUT / "viewer-conversations.png"), full_page=True)

    page.click(f"tr[data-conversation='{OWNER_CONVERSATION}'] td:first-child a")
    expect(page).to_have_url(f"{served_url}/viewer/conversations/{OWNER_CONVERSATION}")
    expect(page.locator("article.message")).to_have_count(12)
    for role, count in {"system": 1, "user": 3, "assistant": 5, "tool": 3}.items():
        messages = page.locator(f"article[data-role='{role}']")
        expect(messages).to_have_count(count)
        expect(messages.first).to_be_visible()
    expect(page.locator(".tool-call").first).to_contain_text("get_weather")
    expect(page.locator(".tool-call").first).to_contain_text('"city": "Paris"')
    expect(page.locator(".hitl")).to_contain_text("confirm_booking")
    expect(page.locator(".upload")).to_contain_text("id-card.pdf")
    expect(page.locator(".error")).to_contain_text("Booking service unavailable")
    expect(page.locator(".usage").first).to_contain_text("640 ms")
    page.screenshot(path=str(OUTPUT / "viewer-transcript.png"), full_page=True)

    page.click("text=compare with legacy turns")
    expect(page.locator("article[data-legacy-turn]")).to_have_count(4)
    expect(page.locator(".legacy")).to_contain_text("Unknown part type 'sticker'")
    page.screenshot(path=str(OUTPUT / "viewer-legacy.png"), full_page=True)

    assert errors == []  # e.g. a style or script blocked by the Content-Security-Policy
    context.close()


LONG = "conv-browser-long"
CUT = "conv-browser-cut"


def _post_turn(
    base: str, conversation_id: str, messages: list[dict[str, Any]], user_id: str = OWNER
) -> None:
    body = json.dumps({"user_id": user_id, "messages": messages}).encode()
    request = urllib.request.Request(
        f"{base}/v1/conversations/{conversation_id}/turns",
        data=body,
        headers={"Authorization": f"Bearer {SERVICE_TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 201


def test_a_direction_override_shows_as_its_escape_not_reversing_the_text(
    served_url: str, browser: object
) -> None:
    """A runtime's prompt asks a person to confirm a payee holding a right-to-left override
    (sent as the JSON escape `\\u202e`), with an upload named with one: the page, as
    Chromium lays it out, shows each as its escape, the words in the order they were
    written ("ACME \\u202e0021 EUR", never "ACME RUE 1200"), on the transcript and the
    list."""
    from playwright.sync_api import expect

    payee = {"payee": "ACME \u202e0021 EUR"}
    asked = {"action": "confirm\u202e", "request_id": "r-rlo", "params": payee}
    upload = {"filename": "invoice\u202efdp.exe", "file_type": "application/pdf", "size": 3}
    _post_turn(
        served_url,
        "conv-browser-rlo",
        [
            {"role": "user", "content": "pay ACME", "upload": upload},
            {"role": "assistant", "content": "Confirm?", "hitl_action": asked},
        ],
        user_id="user-rlo",
    )
    OUTPUT.mkdir(exist_ok=True)
    page, errors = _signed_in_page(browser, served_url)

    page.goto(f"{served_url}/viewer/conversations/conv-browser-rlo")
    expect(page.locator(".hitl pre")).to_contain_text('"payee": "ACME \\u202e0021 EUR"')
    expect(page.locator(".upload strong")).to_have_text("Uploaded invoice\\u202efdp.exe")
    expect(page.locator("p.banner.hitl code")).to_have_text("confirm\\u202e")
    assert "\u202e" not in page.locator("main").inner_text()
    page.screenshot(path=str(OUTPUT / "viewer-hidden-characters.png"), full_page=True)
    page.goto(f"{served_url}/viewer/users/user-rlo")
    row = page.locator("tr[data-conversation='conv-browser-rlo']")
    expect(row.locator(".badge.hitl")).to_have_text("awaiting confirm\\u202e")
    assert "\u202e" not in page.locator("main").inner_text()
    assert errors == []


@pytest.fixture(scope="module")
def wire_served_url(wire_uri: str) -> Iterator[str]:
    """The app as deployed: it opens its own store on the wire server and loads the demo."""
    settings = api_settings(
        mongodb_uri=wire_uri,
        database=f"browser_{uuid.uuid4().hex[:10]}",
        demo_data=True,
        max_message_bytes=4096,
    )
    for base in serve_in_thread(create_app(settings)):
        messages = [{"role": "user", "content": f"Step {n} of a long session"} for n in range(230)]
        _post_turn(base, LONG, messages)
        _post_turn(base, CUT, [{"role": "user", "content": "a long pasted text " * 400}])
        yield base


def _signed_in_page(browser: object, base: str) -> tuple[Any, list[str]]:
    from playwright.sync_api import Browser

    assert isinstance(browser, Browser)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{base}/viewer/login")
    page.fill("#token", SERVICE_TOKEN)
    page.click("main button[type=submit]")
    page.wait_for_url(f"{base}/viewer")
    return page, errors


@pytest.mark.wire
def test_a_person_starts_from_recent_conversations_searches_pages_and_forks(
    wire_served_url: str, browser: object
) -> None:
    from playwright.sync_api import expect

    base = wire_served_url
    OUTPUT.mkdir(exist_ok=True)
    page, errors = _signed_in_page(browser, base)

    expect(page.locator("h1")).to_have_text("Recent conversations")
    rows = page.locator("tr[data-conversation]")
    expect(rows.first).to_have_attribute("data-conversation", CUT)  # the last logged first
    assert rows.count() >= 5
    expect(page.locator("a.legacy-link")).to_have_count(1)  # only the example has legacy turns
    expect(
        page.locator(f"tr[data-conversation='{OWNER_CONVERSATION}'] a.legacy-link")
    ).to_be_visible()
    page.screenshot(path=str(OUTPUT / "viewer-landing.png"), full_page=True)

    page.fill("#q", "Paris")
    page.fill("#search_user", OWNER)
    page.click("form.search button[type=submit]")
    expect(page.locator("li.hit").first).to_be_visible()
    expect(page.locator("li.hit").first).to_have_attribute("data-conversation", OWNER_CONVERSATION)
    page.screenshot(path=str(OUTPUT / "viewer-search.png"), full_page=True)

    page.goto(f"{base}/viewer/conversations/{LONG}")
    expect(page.locator("article.message")).to_have_count(100)
    page.click("a[rel=next] >> nth=0")
    expect(page).to_have_url(f"{base}/viewer/conversations/{LONG}?from_seq=100")
    expect(page.locator("article.message").first).to_have_attribute("data-seq", "100")
    page.screenshot(path=str(OUTPUT / "viewer-transcript-paged.png"), full_page=True)

    page.goto(f"{base}/viewer/conversations/{CUT}")
    page.click("text=show the full text")
    expect(page.locator("article.message .content")).to_contain_text("a long pasted text " * 50)
    expect(page.locator("text=show the full text")).to_have_count(0)

    page.goto(f"{base}/viewer/conversations/{OWNER_CONVERSATION}")
    said = page.locator("article[data-role='user']").nth(1)  # a person's message mid-way
    seq = int(said.get_attribute("data-seq") or "")
    said.locator("form.fork button").click()
    expect(page.locator("p.forked")).to_contain_text(
        f"Continued from {OWNER_CONVERSATION} at #{seq}"
    )
    expect(page.locator("article.message")).to_have_count(seq + 1)
    page.screenshot(path=str(OUTPUT / "viewer-fork.png"), full_page=True)
    assert errors == []


def test_the_api_page_renders_every_operation_from_bundled_files(
    served_url: str, browser: object
) -> None:
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    OUTPUT.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    elsewhere: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on(
        "request",
        lambda r: None if r.url.startswith((served_url, "data:")) else elsewhere.append(r.url),
    )
    page.goto(f"{served_url}/docs")
    expect(page.locator(".opblock").first).to_be_visible(timeout=20_000)
    turns = "/v1/conversations/{conversation_id}/turns"
    expect(page.locator(f".opblock-summary-path[data-path='{turns}']")).to_be_visible()
    assert page.locator(".opblock").count() >= 20
    page.screenshot(path=str(OUTPUT / "api-docs.png"), full_page=False)
    assert errors == []  # e.g. a script blocked by the Content-Security-Policy
    assert elsewhere == []  # no CDN: every file comes from the service
    context.close()
