"""`python -m app` (what `make run` starts): demo data on an empty store, a URL and a token."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from app.demo import demo_conversations, load_demo
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID
from app.service import Store
from app.settings import Settings
from tests.api_harness import mongomock_db


async def test_demo_data_loads_only_into_an_empty_store() -> None:
    store = Store.on(mongomock_db(), Settings())
    assert await load_demo(store) is True
    assert await load_demo(store) is False
    stored = await store.db["agent_messages"].count_documents({})
    expected = sum(len(m) for _, _, turns in demo_conversations() for _, m in turns)
    assert stored == expected
    example = await store.conversations.get_conversation(EXAMPLE_CONVERSATION_ID)
    assert (example.user_id, example.message_count) == (EXAMPLE_USER_ID, 12)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.wire
@pytest.mark.skipif(sys.version_info < (3, 13), reason="the embedded server needs Python 3.13+")
def test_run_serves_demo_conversations_and_prints_the_url_and_a_token(tmp_path: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
    env |= {"AGENT_STORE_DATA_DIR": str(tmp_path), "AGENT_STORE_PORT": str(port)}
    process = subprocess.Popen(
        [sys.executable, "-m", "app"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        printed = ""
        while "Viewer:" not in printed:
            line = process.stdout.readline()
            assert line, f"python -m app ended early:\n{printed}"
            printed += line
        token = re.search(r"development token for this run: (\S+)", printed)
        assert token, printed
        assert f"http://127.0.0.1:{port}/viewer" in printed
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/users/{EXAMPLE_USER_ID}/conversations",
            headers={"Authorization": f"Bearer {token.group(1)}"},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    page = json.load(response)
                break
            except OSError:
                assert time.monotonic() < deadline, "the service did not answer in 60 s"
                time.sleep(0.2)
        assert EXAMPLE_CONVERSATION_ID in {c["_id"] for c in page["data"]}
    finally:
        process.terminate()
        process.wait(20)
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.parametrize(
    ("installed", "loop"), [(True, "uvloop"), (False, "asyncio")], ids=["uvloop", "no-uvloop"]
)
def test_python_m_app_runs_on_uvloop_when_it_is_installed(
    monkeypatch: pytest.MonkeyPatch, installed: bool, loop: str
) -> None:
    import app.__main__ as entry

    served: dict[str, object] = {}
    monkeypatch.setattr(entry.uvicorn, "run", lambda app, **options: served.update(options))
    monkeypatch.setenv("AGENT_STORE_SERVICE_TOKENS", '["a-token"]')
    if not installed:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed

    entry.main()

    assert served["loop"] == loop
