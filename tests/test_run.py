"""`python -m app` (what `make run` starts): demo data on an empty store, a URL and a token."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

from agent_store import embedded
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


@dataclass
class Running:
    """`python -m app` on the embedded database, with everything it printed so far."""

    base: str
    token: str
    output: list[str]

    def get(self, path: str) -> Any:
        request = urllib.request.Request(
            self.base + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.load(response)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
    env |= {
        "AGENT_STORE_DATA_DIR": str(tmp_path_factory.mktemp("run")),
        "AGENT_STORE_PORT": str(port),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "app"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(process.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("Viewer:" in line for line in output):
            assert process.poll() is None, "python -m app ended early:\n" + "".join(output)
            assert time.monotonic() < deadline, "python -m app printed no URL in 60 s"
            time.sleep(0.05)
        token = re.search(r"development token for this run: (\S+)", "".join(output))
        assert token, "".join(output)
        app = Running(f"http://127.0.0.1:{port}", token.group(1), output)
        while True:
            try:
                app.get("/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "the service did not answer in 60 s"
                time.sleep(0.2)
        yield app
    finally:
        process.terminate()
        process.wait(20)
        reader.join(10)
        process.stdout.close()


@pytest.mark.wire
def test_run_serves_demo_conversations_and_prints_the_urls_and_a_token(running: Running) -> None:
    printed = "".join(running.output)
    assert f"{running.base}/viewer" in printed
    page = running.get(f"/v1/users/{EXAMPLE_USER_ID}/conversations")
    assert EXAMPLE_CONVERSATION_ID in {c["_id"] for c in page["data"]}
    mongodb = re.search(r"MongoDB: (mongodb://\S+)", printed)
    assert mongodb, f"the embedded database's URI is not printed:\n{printed}"
    client: MongoClient[dict[str, object]] = MongoClient(mongodb.group(1))
    with client:
        stored = client["agent_store"]["agent_conversations"].find_one(
            {"_id": EXAMPLE_CONVERSATION_ID}
        )
    assert stored is not None
    assert stored["user_id"] == EXAMPLE_USER_ID


@pytest.mark.wire
def test_run_logs_one_json_line_per_request_without_its_query(running: Running) -> None:
    start = len(running.output)
    running.get("/v1/users/user-audited/conversations?limit=7")
    for _ in range(3):
        running.get("/health")
        running.get("/ready")
    running.get("/v1/users/user-last/conversations")  # logged after every request before it
    deadline = time.monotonic() + 10
    while not any("user-last" in line for line in running.output[start:]):
        assert time.monotonic() < deadline, "".join(running.output)
        time.sleep(0.05)
    printed = running.output[start:]
    mine = [line for line in printed if "user-audited" in line]
    assert len(mine) == 1, printed  # one line per request, from the audit logger only
    line = json.loads(mine[0])  # the whole line is one JSON object
    assert line["logger"] == "agent_store.audit"
    assert line["path"] == "/v1/users/user-audited/conversations"
    assert line["route"] == "/v1/users/{user_id}/conversations"
    assert (line["status"], line["user"]) == (200, None)
    assert line["service"].startswith("token-sha256:")
    assert not any('"GET /' in line for line in printed), printed  # no uvicorn access line
    assert "/health" not in "".join(printed)  # probes are not logged
    assert "/ready" not in "".join(printed)
    assert "limit=7" not in "".join(printed)


@pytest.mark.parametrize(
    ("installed", "loop"), [(True, "uvloop"), (False, "asyncio")], ids=["uvloop", "no-uvloop"]
)
def test_python_m_app_runs_on_uvloop_when_it_is_installed(
    monkeypatch: pytest.MonkeyPatch, installed: bool, loop: str
) -> None:
    import app.__main__ as entry

    served_on: list[str] = []

    async def serve(settings: object, *, dev_token: str | None) -> None:
        served_on.append(type(asyncio.get_running_loop()).__module__)

    monkeypatch.setattr(entry, "serve", serve)
    monkeypatch.setattr(entry, "configure_logging", lambda level: None)
    monkeypatch.setenv("AGENT_STORE_SERVICE_TOKENS", '["' + "t" * 32 + '"]')
    monkeypatch.delenv("MONGODB_URI", raising=False)
    if not installed:
        monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed

    entry.main()

    assert [module.split(".")[0] for module in served_on] == [loop]


@pytest.mark.wire
def test_the_service_on_a_data_dir_another_process_holds_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    """As settings' refusals are (exit 2), never a traceback: a second `make run`, or one
    beside a migration that opened the embedded database itself."""
    import fcntl

    with (tmp_path / embedded.LOCK_FILE).open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("4242")
        lock.flush()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
        env |= {"AGENT_STORE_DATA_DIR": str(tmp_path), "AGENT_STORE_PORT": str(_free_port())}
        finished = subprocess.run(
            [sys.executable, "-m", "app"], env=env, capture_output=True, text=True, timeout=60
        )
    assert finished.returncode == 2, finished.stderr
    assert finished.stderr.startswith("invalid configuration: data_dir: "), finished.stderr
    assert finished.stderr.count("\n") == 1, finished.stderr
    assert "process 4242" in finished.stderr


@pytest.mark.wire
def test_the_service_stopped_by_sigterm_withdraws_its_published_uri(tmp_path: Path) -> None:
    """`docker stop`, `systemctl stop`: the embedded server closes and its URI file goes, and
    the process still ends by the signal, as uvicorn ends it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
    env |= {"AGENT_STORE_DATA_DIR": str(tmp_path), "AGENT_STORE_PORT": str(_free_port())}
    process = subprocess.Popen(
        [sys.executable, "-m", "app"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    try:
        for line in process.stdout:
            if "Viewer:" in line:
                break
        assert (tmp_path / embedded.URI_FILE).exists()
        time.sleep(1)  # uvicorn serving
        process.terminate()
        assert process.wait(30) == -signal.SIGTERM
    finally:
        process.kill()
        process.stdout.close()
    assert not (tmp_path / embedded.URI_FILE).exists()
