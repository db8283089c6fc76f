"""The viewer in a real browser: Debian's headless Chromium against the app served by uvicorn.

Screenshots land in tests/output/. A missing /usr/bin/chromium fails the test
(`.ci/run` installs it), so the browser check never silently disappears.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

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
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, store=store), log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.fail(
            "/usr/bin/chromium is missing: install Debian's package "
            "(apt-get install -y chromium; .ci/run does it)"
        )
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
