"""The TypeScript reader, run: the official MongoDB Node.js driver and `fetch` on `make run`.

`python -m app` starts as `make run` does (the embedded database, demo data, the
banner with both URLs); clients/typescript/smoke.ts, compiled with `tsc --strict`
against the generated declarations, reads the example conversation from the
collections and from every API route through the typed functions of example.ts
and validates each document and payload against schemas/ with Ajv. The driver,
Ajv and TypeScript are pinned in clients/typescript/package-lock.json;
`make test` installs them (`npm ci`) before pytest runs.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID

pytestmark = pytest.mark.wire  # the embedded server (Python 3.13+)

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients" / "typescript"
TOKEN = "node-smoke-token-" + "x" * 32


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


NODE_AT_LEAST = (20, 19)
"""What the pinned driver (mongodb 7.9) requires."""


def _node_toolchain() -> tuple[str, Path]:
    node = shutil.which("node")
    assert node, "node is not installed: the TypeScript reader needs Node.js 20.19+"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    major, minor = (int(part) for part in version.stdout.strip().lstrip("v").split(".")[:2])
    assert (major, minor) >= NODE_AT_LEAST, f"Node.js {version.stdout.strip()}: 20.19+ is needed"
    tsc = CLIENT / "node_modules" / ".bin" / "tsc"
    missing = "clients/typescript/node_modules is missing: run `make types-check` (npm ci)"
    assert (CLIENT / "node_modules" / "mongodb").is_dir(), missing
    assert tsc.exists(), missing
    return node, tsc


@dataclass(frozen=True)
class Service:
    api: str
    mongodb_uri: str
    banner: str


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`python -m app` as `make run` starts it, until the module's tests are done."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
    env |= {
        "AGENT_STORE_DATA_DIR": str(tmp_path_factory.mktemp("data")),
        "AGENT_STORE_PORT": str(port),
        "AGENT_STORE_SERVICE_TOKENS": f'["{TOKEN}"]',
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "app"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = ""
        while "Viewer:" not in banner:
            line = process.stdout.readline()
            assert line, f"python -m app ended early:\n{banner}"
            banner += line
        mongodb = re.search(r"MongoDB: (mongodb://\S+)", banner)
        assert mongodb, f"the banner names no MongoDB URI:\n{banner}"
        api = f"http://127.0.0.1:{port}"
        _wait_until_ready(api)
        yield Service(api, mongodb.group(1), banner)
    finally:
        process.terminate()
        process.wait(30)
        if process.stdout is not None:
            process.stdout.close()


def _wait_until_ready(api: str) -> None:
    request = urllib.request.Request(f"{api}/ready", headers={"Authorization": f"Bearer {TOKEN}"})
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except OSError:
            assert time.monotonic() < deadline, "the service was not ready in 60 s"
            time.sleep(0.2)


def test_the_typescript_reader_compiles_under_strict_against_the_declarations() -> None:
    _, tsc = _node_toolchain()
    compiled = subprocess.run(
        [str(tsc), "-p", str(CLIENT)], cwd=CLIENT, capture_output=True, text=True, timeout=300
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert (CLIENT / "build" / "smoke.js").exists()


def test_the_node_driver_and_fetch_read_the_example_conversation_as_the_schemas_say(
    service: Service,
) -> None:
    node, _ = _node_toolchain()
    smoke = CLIENT / "build" / "smoke.js"
    if not smoke.exists():  # run alone: compile first
        test_the_typescript_reader_compiles_under_strict_against_the_declarations()
    run = subprocess.run(
        [node, str(smoke)],
        cwd=CLIENT,
        env=os.environ
        | {
            "MONGODB_URI": service.mongodb_uri,
            "API_BASE": service.api,
            "API_TOKEN": TOKEN,
            "CONVERSATION_ID": EXAMPLE_CONVERSATION_ID,
            "USER_ID": EXAMPLE_USER_ID,
            "SCHEMA_DIR": str(ROOT / "schemas"),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert re.search(r"^\d+ passed, 0 failed$", run.stdout, re.M), report
