"""Deploying the service: the factory under uvicorn and gunicorn, probes, proxies, settings.

The servers run as real processes on loopback, as a deployment would start them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from app.settings import ConfigurationError, Settings, serving_settings, uvicorn_options

TOKEN = "deploy-test-token-0123456789abcdefghij"
PUBLIC = ("/health", "/ready", "/docs", "/openapi.json", "/metrics")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _environment(data_dir: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
    return (
        env
        | {
            "AGENT_STORE_DATA_DIR": str(data_dir),
            "AGENT_STORE_SERVICE_TOKENS": json.dumps([TOKEN]),
            "AGENT_STORE_DEMO_DATA": "false",
        }
        | settings
    )


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@contextmanager
def _started(
    command: list[str], env: dict[str, str], port: int, output: list[str] | None = None
) -> Iterator[str]:
    """Run `command` until the service on `port` answers `/health`; yield its base URL.

    What the process printed is appended to `output` once it has stopped.
    """
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0]
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the service did not answer in 60 s"
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        printed, _ = process.communicate(timeout=30)
        if output is not None:
            output.extend(printed.splitlines())


def _probe_every_public_route(base: str) -> None:
    for path in PUBLIC:
        status, body = _get(base + path)
        assert status == 200, (path, body[:300])
    assert json.loads(_get(base + "/ready")[1]) == {"status": "ready", "database": "reachable"}
    status, _ = _get(base + "/v1/users/user-ada/conversations")
    assert status == 401  # the data still needs a token
    status, body = _get(
        base + "/v1/users/user-ada/conversations", {"Authorization": f"Bearer {TOKEN}"}
    )
    assert (status, json.loads(body)["data"]) == (200, [])


@pytest.mark.wire
def test_uvicorn_factory_reads_the_environment_and_answers_probes_without_a_token(
    tmp_path: Path,
) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "uvicorn", "--factory", "app.api:create_app"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    output: list[str] = []
    with _started(command, _environment(tmp_path), port, output) as base:
        _probe_every_public_route(base)
    # uvicorn's own access log is on by default; the factory leaves one JSON line per request.
    requests = [json.loads(line) for line in output if '"agent_store.audit"' in line]
    assert [(r["path"], r["status"]) for r in requests] == [
        ("/docs", 200),
        ("/openapi.json", 200),
        ("/v1/users/user-ada/conversations", 401),
        ("/v1/users/user-ada/conversations", 200),
    ]
    assert not any('"GET /' in line for line in output), output


@pytest.mark.wire
def test_gunicorn_uvicorn_workers_serve_the_factory(tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "gunicorn", "app.api:create_app()"]
    command += ["--worker-class", "uvicorn_worker.UvicornWorker", "--workers", "1"]
    command += ["--bind", f"127.0.0.1:{port}"]
    with _started(command, _environment(tmp_path), port) as base:
        _probe_every_public_route(base)


@pytest.mark.wire
def test_python_m_app_serves_several_workers_on_a_real_database(
    tmp_path: Path, wire_uri: str
) -> None:
    port = _free_port()
    env = _environment(
        tmp_path,
        MONGODB_URI=wire_uri,
        AGENT_STORE_DATABASE=f"deploy_{port}",
        AGENT_STORE_PORT=str(port),
        AGENT_STORE_WORKERS="2",
    )
    output: list[str] = []
    with _started([sys.executable, "-m", "app"], env, port, output) as base:
        _probe_every_public_route(base)
    started = [line for line in output if "Started server process" in line]
    assert len(started) == 2, output  # two worker processes served the factory


@pytest.mark.wire
@pytest.mark.parametrize(
    ("trusted", "client"),
    [
        pytest.param('["127.0.0.1"]', "203.0.113.9", id="trusted-proxy"),
        pytest.param("[]", "127.0.0.1", id="untrusted-proxy"),
    ],
)
def test_the_client_address_comes_from_trusted_proxies_only(
    tmp_path: Path, trusted: str, client: str
) -> None:
    port = _free_port()
    env = _environment(
        tmp_path,
        AGENT_STORE_PORT=str(port),
        AGENT_STORE_TRUSTED_PROXIES=trusted,
        AGENT_STORE_LOG_LEVEL="info",
    )
    output: list[str] = []
    with _started([sys.executable, "-m", "app"], env, port, output) as base:
        headers = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "203.0.113.9"}
        assert _get(base + "/v1/users/user-proxied/conversations", headers)[0] == 200
    lines = [json.loads(line) for line in output if "user-proxied" in line]
    assert [line["client"] for line in lines] == [client]


def test_uvicorn_runs_with_the_settings_bind_address_workers_proxies_and_log_level() -> None:
    settings = Settings(
        host="0.0.0.0",
        port=9000,
        workers=4,
        trusted_proxies=["10.0.0.0/8", "192.168.1.7"],
        log_level="warning",
        mongodb_uri="mongodb://db.example/",
    )
    options = uvicorn_options(settings)
    assert options | {"forwarded_allow_ips": "…"} == {
        "host": "0.0.0.0",
        "port": 9000,
        "workers": 4,
        "factory": True,
        "proxy_headers": True,
        "forwarded_allow_ips": "…",
        "log_level": "warning",
        "access_log": False,
        "server_header": False,
    }
    assert options["forwarded_allow_ips"] == "10.0.0.0/8,192.168.1.7"


def test_several_workers_need_a_real_database() -> None:
    with pytest.raises(ConfigurationError, match="MONGODB_URI"):
        serving_settings(Settings(workers=2), demo_explicit=False)


def test_the_api_page_needs_the_schema() -> None:
    with pytest.raises(ValueError, match="expose_docs needs expose_openapi"):
        Settings(expose_openapi=False)
