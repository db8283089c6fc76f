"""Configuration the service refuses to start with, and what it prints when it does start."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bson
import certifi
import jwt
import pytest
from bson import Int64
from pydantic import ValidationError

from agent_store.store import (
    MAX_MESSAGE_BYTES,
    MONGODB_MAX_DOCUMENT_BYTES,
    TurnRules,
    plan_turn,
    redact_uri,
)
from app.__main__ import start_banner
from app.settings import ConfigurationError, Settings, serving_settings, settings_from_environment
from tests.api_harness import (
    AUDIENCE,
    ISSUER,
    JWT_SECRET,
    OWNER_CONVERSATION,
    api_settings,
    auth_headers,
    mongomock_db,
    serve,
)

STRONG = "s" * 32


def refusal(**values: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        Settings(**values)
    return str(caught.value)


@pytest.mark.parametrize(
    "token",
    [
        pytest.param("", id="empty"),
        pytest.param("short", id="short"),
        pytest.param("x" * 31, id="31-characters"),
        pytest.param(" " * 40, id="spaces"),
        pytest.param("a-long-enough-token with a space inside", id="inner-space"),
    ],
)
def test_a_weak_service_token_is_refused_without_being_echoed(token: str) -> None:
    for values in ({"service_tokens": [STRONG, token]}, {"named_service_tokens": {"ui": token}}):
        message = refusal(**values)
        assert "at least 32" in message
        if token.strip():
            assert token not in message


def test_an_empty_token_list_from_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENT_STORE_SERVICE_TOKENS", '[""]')
    with pytest.raises(ValidationError, match="at least 32"):
        Settings()


def test_a_named_token_needs_a_name() -> None:
    assert "name" in refusal(named_service_tokens={"": STRONG})


@pytest.mark.parametrize(
    ("algorithm", "weak", "enough"),
    [("HS256", 31, 32), ("HS384", 47, 48), ("HS512", 63, 64)],
)
def test_an_hmac_secret_shorter_than_its_hash_is_refused(
    algorithm: str, weak: int, enough: int
) -> None:
    message = refusal(jwt_algorithms=[algorithm], jwt_secret="k" * weak)
    assert f"at least {enough} bytes" in message
    assert "k" * weak not in message
    Settings(jwt_algorithms=[algorithm], jwt_secret="k" * enough)


def test_a_three_byte_jwt_secret_is_refused() -> None:
    assert "at least 32 bytes" in refusal(jwt_secret="abc")


def test_a_dev_token_is_invented_only_for_the_embedded_database() -> None:
    with pytest.raises(ConfigurationError, match="AGENT_STORE_SERVICE_TOKENS"):
        serving_settings(Settings(mongodb_uri="mongodb://db.example:27017"), demo_explicit=False)
    settings, dev_token = serving_settings(Settings(), demo_explicit=False)
    assert dev_token is not None
    assert len(dev_token) >= 32
    assert settings.service_tokens == [dev_token]
    configured, none = serving_settings(
        Settings(mongodb_uri="mongodb://db", service_tokens=[STRONG]), demo_explicit=False
    )
    assert none is None
    assert configured.service_tokens == [STRONG]


@pytest.mark.parametrize(
    ("uri", "redacted"),
    [
        ("mongodb://ada:s3cret@db1:27017,db2/?replicaSet=rs0", "mongodb://ada:***@db1:27017,db2/"),
        ("mongodb+srv://ada:p%40ss@cluster.example/app", "mongodb+srv://ada:***@cluster.example/"),
        ("mongodb://db/?tlsCertificateKeyFilePassword=hunter2", "mongodb://db/?"),
        (
            "mongodb://key@db/?authMechanism=MONGODB-AWS&authMechanismProperties="
            "AWS_SESSION_TOKEN:tok",
            "authMechanismProperties=***",
        ),
        ("mongodb://localhost", "mongodb://localhost"),
    ],
)
def test_printed_uris_hide_their_credentials(uri: str, redacted: str) -> None:
    printed = redact_uri(uri)
    assert redacted in printed
    for secret in ("s3cret", "p%40ss", "hunter2", ":tok"):
        assert secret not in printed


def test_the_start_banner_prints_no_password() -> None:
    settings = Settings(mongodb_uri="mongodb://ada:s3cret@db.example/", service_tokens=[STRONG])
    banner = "\n".join(start_banner(settings, dev_token=None))
    assert "mongodb://ada:***@db.example/" in banner
    assert "s3cret" not in banner
    assert STRONG not in banner


def _run_app(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_STORE_", "MONGODB"))}
    return subprocess.run(
        [sys.executable, "-m", "app"],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_service_will_not_invent_a_token_for_a_real_database() -> None:
    finished = _run_app({"MONGODB_URI": "mongodb://ada:s3cret@127.0.0.1:9/"})
    assert finished.returncode == 2
    assert "AGENT_STORE_SERVICE_TOKENS" in finished.stderr
    assert "development token" not in finished.stdout
    assert "s3cret" not in finished.stdout + finished.stderr


def test_the_service_will_not_start_with_a_weak_token() -> None:
    finished = _run_app({"AGENT_STORE_SERVICE_TOKENS": '["hunter2"]'})
    assert finished.returncode == 2
    assert "at least 32" in finished.stderr
    assert "hunter2" not in finished.stdout + finished.stderr


def _token_living(seconds: int, **claims: Any) -> str:
    now = int(time.time())
    payload = {"sub": "user-ada", "aud": AUDIENCE, "iss": ISSUER, "iat": now, "exp": now + seconds}
    payload.update(claims)
    return jwt.encode({k: v for k, v in payload.items() if v is not None}, JWT_SECRET, "HS256")


@pytest.mark.parametrize(
    ("max_seconds", "lifetime", "status"),
    [
        pytest.param(3600, 300, 200, id="short-lived"),
        pytest.param(3600, 3600, 200, id="exactly-the-maximum"),
        pytest.param(3600, 2 * 3600, 401, id="two-hours-by-default"),
        pytest.param(4 * 3600, 2 * 3600, 200, id="two-hours-when-allowed"),
        pytest.param(3600, 365 * 86400, 401, id="a-year"),
    ],
)
async def test_user_tokens_living_longer_than_the_maximum_are_refused(
    max_seconds: int, lifetime: int, status: int
) -> None:
    settings = api_settings(max_user_token_seconds=max_seconds)
    async with serve(mongomock_db(), settings) as api:
        headers = auth_headers() | {"X-User-JWT": _token_living(lifetime)}
        response = await api.http.get(f"/v1/conversations/{OWNER_CONVERSATION}", headers=headers)
        assert response.status_code == status, response.text
        if status == 401:
            assert "lifetime" in response.json()["error"]["message"]


@pytest.mark.parametrize("over", [0.4, 0.5, 1.5], ids=["0.4-s-over", "0.5-s-over", "1.5-s-over"])
async def test_the_refusal_of_a_token_living_too_long_shows_a_lifetime_over_the_maximum(
    over: float,
) -> None:
    async with serve(mongomock_db()) as api:
        now = int(time.time())
        token = _token_living(3600, iat=now, exp=now + 3600 + over)
        headers = auth_headers() | {"X-User-JWT": token}
        response = await api.http.get(f"/v1/conversations/{OWNER_CONVERSATION}", headers=headers)
        assert response.status_code == 401
        message = response.json()["error"]["message"]
        shown = re.search(r"lifetime \(exp - iat\) is (\d+) s", message)
        assert shown is not None, message
        assert int(shown[1]) > 3600, message


async def test_a_user_token_without_an_issue_time_is_refused() -> None:
    async with serve(mongomock_db()) as api:
        headers = auth_headers() | {"X-User-JWT": _token_living(300, iat=None)}
        response = await api.http.get(f"/v1/conversations/{OWNER_CONVERSATION}", headers=headers)
        assert response.status_code == 401
        assert "iat" in response.json()["error"]["message"]


def test_the_migration_tool_prints_no_password(capsys: pytest.CaptureFixture[str]) -> None:
    from migrations.cli import main

    closed = "mongodb://ada:s3cret@127.0.0.1:9/?directConnection=true"
    assert main(["status", "--uri", closed, "--timeout", "0.2"]) == 4
    assert main(["status", "--uri", "mongodb://ada:s3cret@/?bogus"]) == 4
    printed = capsys.readouterr()
    assert "mongodb://ada:***@127.0.0.1:9/" in printed.err
    assert "s3cret" not in printed.out + printed.err


@pytest.mark.parametrize(
    ("variable", "value", "shape"),
    [
        pytest.param("AGENT_STORE_SERVICE_TOKENS", "t" * 40, "JSON list", id="tokens"),
        pytest.param("AGENT_STORE_TRUSTED_PROXIES", "10.0.0.1", "JSON list", id="proxies"),
        pytest.param("AGENT_STORE_JWT_ALGORITHMS", "RS256", "JSON list", id="algorithms"),
        pytest.param(
            "AGENT_STORE_NAMED_SERVICE_TOKENS", "admin:" + "t" * 40, "JSON object", id="named"
        ),
    ],
)
def test_a_list_or_object_setting_given_as_plain_text_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, shape: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    field = variable.removeprefix("AGENT_STORE_").lower()
    assert str(caught.value).startswith(f"{field}: ")
    assert shape in str(caught.value)
    assert "t" * 40 not in str(caught.value)


def test_python_m_app_refuses_a_plain_text_token_list_with_exit_2_and_no_traceback() -> None:
    finished = _run_app({"AGENT_STORE_SERVICE_TOKENS": "t" * 40})
    assert finished.returncode == 2
    assert finished.stderr.startswith("invalid configuration: service_tokens: ")
    assert "Traceback" not in finished.stderr
    assert "t" * 40 not in finished.stdout + finished.stderr


@pytest.mark.parametrize("port", [0, 65536, 70000])
def test_a_port_outside_the_tcp_range_is_refused(port: int) -> None:
    assert "port" in refusal(port=port)


def test_the_highest_tcp_port_is_accepted() -> None:
    assert Settings(port=65535).port == 65535


def _rsa_public_pem() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem.decode()


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("nonsense", id="garbage"),
        pytest.param(_rsa_public_pem()[:200], id="truncated"),
    ],
)
def test_a_jwt_public_key_that_does_not_load_is_refused_at_start(key: str) -> None:
    message = refusal(jwt_algorithms=["RS256"], jwt_public_key=key)
    assert "jwt_public_key" in message
    assert key not in message


def test_a_valid_jwt_public_key_is_accepted() -> None:
    pem = _rsa_public_pem()
    assert Settings(jwt_algorithms=["RS256"], jwt_public_key=pem).jwt_public_key == pem


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param(".", id="dot"),
        pytest.param("/", id="slash"),
        pytest.param("a/b.c", id="path"),
        pytest.param("with space", id="space"),
        pytest.param("a" * 64, id="64-bytes"),
    ],
)
def test_a_database_name_mongodb_refuses_is_refused(name: str) -> None:
    assert "database" in refusal(database=name)


@pytest.mark.parametrize("field", ["runtime_context_start", "runtime_context_end"])
@pytest.mark.parametrize(
    "blank",
    [
        pytest.param("", id="empty"),
        pytest.param(" ", id="a-space"),
        pytest.param("\t", id="a-tab"),
        pytest.param(" \n\u00a0", id="mixed-white-space"),
    ],
)
def test_blank_runtime_context_markers_are_refused_naming_them(
    monkeypatch: pytest.MonkeyPatch, field: str, blank: str
) -> None:
    """A marker of white space alone would match between the user's words: every user message
    would be stored cut at its first or last space."""
    monkeypatch.setenv(f"AGENT_STORE_{field.upper()}", blank)
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    assert str(caught.value).startswith(f"{field}: ")
    assert "white space" in str(caught.value)


def test_runtime_context_markers_equal_to_each_other_are_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENT_STORE_RUNTIME_CONTEXT_START", "<ctx>")
    monkeypatch.setenv("AGENT_STORE_RUNTIME_CONTEXT_END", "<ctx>")
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    assert "runtime_context_start" in str(caught.value)
    assert "runtime_context_end" in str(caught.value)
    assert "tell them apart" in str(caught.value)


def test_runtime_context_markers_with_white_space_around_their_text_are_accepted() -> None:
    settings = Settings(runtime_context_start="<<CONTEXT\n", runtime_context_end="\nCONTEXT>>")
    assert settings.turn_rules().markers.start == "<<CONTEXT\n"


@pytest.mark.parametrize("host", ["", " ", "\t"], ids=["empty", "a-space", "a-tab"])
def test_a_blank_host_is_refused_rather_than_bind_every_interface(
    monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    """`AGENT_STORE_HOST=${HOST}` with HOST unset: asyncio would listen on every interface,
    which only `0.0.0.0` (or `::`) asks for."""
    monkeypatch.setenv("AGENT_STORE_HOST", host)
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    assert str(caught.value).startswith("host: ")
    assert "0.0.0.0" in str(caught.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "::", "localhost"])
def test_an_address_or_host_name_is_a_host(host: str) -> None:
    assert Settings(host=host).host == host


@pytest.mark.parametrize(
    "uri",
    [
        pytest.param("postgres://ada:s3cret@x", id="other-scheme"),
        pytest.param("localhost:27017", id="no-scheme"),
        pytest.param("mongodb://ada:s3cret@", id="no-host"),
    ],
)
def test_a_mongodb_uri_that_is_not_a_connection_string_is_refused(uri: str) -> None:
    message = refusal(mongodb_uri=uri)
    assert "MONGODB_URI" in message
    assert "s3cret" not in message


@pytest.fixture
def no_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any DNS lookup fails the test: the settings check a connection string offline."""
    import dns.asyncresolver
    import dns.resolver

    def looked_up(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the settings looked a name up in DNS")

    monkeypatch.setattr(dns.resolver, "resolve", looked_up)
    monkeypatch.setattr(dns.asyncresolver, "resolve", looked_up)
    monkeypatch.setattr(socket, "getaddrinfo", looked_up)


@pytest.mark.usefixtures("no_dns")
@pytest.mark.parametrize(
    "uri",
    [
        "mongodb://127.0.0.1:27017/?replicaSet=rs0",
        "mongodb+srv://ada:pw@cluster.example",
        "mongodb+srv://ada:p%40ss@cluster.example.com/app?retryWrites=true&w=majority&appName=x",
        "mongodb+srv://cluster.example.com/?srvServiceName=custom&srvMaxHosts=2&authSource=admin",
        "mongodb://db.example/?authMechanism=MONGODB-X509&tls=true",
        "mongodb://ada:pw@db.example/?w=0&journal=false&readPreference=nearest&readPreferenceTags=dc:ny",
        f"mongodb://db.example/?tls=true&tlsCAFile={certifi.where()}",
        f"mongodb+srv://cluster.example.com/?tlsCAFile={certifi.where()}&loadBalanced=true",
    ],
)
def test_mongodb_connection_strings_are_accepted(uri: str) -> None:
    assert Settings(mongodb_uri=uri).mongodb_uri == uri


@pytest.mark.usefixtures("no_dns")
@pytest.mark.parametrize(
    ("uri", "why"),
    [
        pytest.param("mongodb+srv://ada:s3cret@cluster.example.com:27017/", "no port", id="port"),
        pytest.param("mongodb+srv://ada:s3cret@a.example.com,b.example.com/", "one host", id="two"),
        pytest.param("mongodb+srv://ada:s3cret@PW@cluster.example.com/", "not a valid", id="at"),
        pytest.param(
            "mongodb+srv://ada:s3cret@cluster.example/?tls=maybe", "not a valid", id="tls"
        ),
        pytest.param("mongodb+srv://ada:s3cret@cluster.example/?nosuch=1", "not a valid", id="opt"),
        pytest.param("mongodb+srv://ada:s3cret@cluster.example/bad$db", "not a valid", id="db"),
        pytest.param("mongodb+srv://", "not a valid", id="no-host"),
        pytest.param(
            "mongodb+srv://ada:s3cret@cluster.example/?directConnection=true",
            "directConnection",
            id="direct",
        ),
        pytest.param(
            "mongodb+srv://ada:s3cret@cluster.example/?loadBalanced=true&replicaSet=rs0",
            "loadBalanced",
            id="balanced-set",
        ),
        pytest.param(
            "mongodb+srv://ada:s3cret@cluster.example/?srvMaxHosts=2&replicaSet=rs0",
            "srvMaxHosts",
            id="max-set",
        ),
        pytest.param(
            "mongodb+srv://ada:s3cret@cluster.example/?srvMaxHosts=2&loadBalanced=true",
            "srvMaxHosts",
            id="max-balanced",
        ),
    ],
)
def test_a_mongodb_srv_uri_that_does_not_parse_is_refused_without_a_dns_lookup(
    uri: str, why: str
) -> None:
    """The driver would refuse it when connecting, after the banner, with its own traceback
    (exit 3, read as "cannot reach the database"): a syntax error is a setting's error."""
    message = refusal(mongodb_uri=uri)
    assert "MONGODB_URI" in message
    assert why in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "scheme", ["mongodb://ada:s3cret@db:27017", "mongodb+srv://ada:s3cret@c.example"]
)
@pytest.mark.parametrize("option", ["tlsCAFile", "tlsCertificateKeyFile"])
def test_a_connection_string_naming_a_tls_file_that_cannot_be_read_is_refused(
    tmp_path: Path, scheme: str, option: str
) -> None:
    """The driver reads the file when it parses the string: a missing one, or a directory,
    was a traceback and exit 1, not a setting's error."""
    for unreadable in (tmp_path / "missing.pem", tmp_path):
        message = refusal(mongodb_uri=f"{scheme}/?tls=true&{option}={unreadable}")
        assert "MONGODB_URI" in message
        assert "s3cret" not in message


@pytest.mark.usefixtures("no_dns")
@pytest.mark.parametrize("scheme", ["mongodb://", "mongodb+srv://"])
@pytest.mark.parametrize(
    ("rest", "why"),
    [
        pytest.param("ada:s3cret@db.example/?w=0&journal=true", "options", id="w0-journal"),
        pytest.param(
            "ada:s3cret@db.example/?readPreference=primary&readPreferenceTags=dc:ny",
            "options",
            id="primary-with-tags",
        ),
        pytest.param(
            "ada:s3cret@db.example/?authMechanism=MONGODB-X509", "options", id="x509-password"
        ),
        pytest.param("db.example/?authMechanism=SCRAM-SHA-256", "options", id="scram-no-user"),
        pytest.param(
            "ada:s3cret@db.example/?tls=false&tlsCAFile={pem}", "options", id="tls-off-with-ca"
        ),
        pytest.param("ada:s3cret@db.example/?tls=true&tlsCAFile={pem}", "PEM", id="ca-not-pem"),
        pytest.param(
            "ada:s3cret@db.example/?tls=true&tlsCertificateKeyFile={pem}", "PEM", id="key-not-pem"
        ),
    ],
)
def test_a_connection_string_the_driver_refuses_to_build_a_client_from_is_refused(
    tmp_path: Path, scheme: str, rest: str, why: str
) -> None:
    """It parses, but the client is refused when the service builds it, after the banner
    (exit 3, read as "cannot reach the database"): told offline, in the setting's words."""
    pem = tmp_path / "mounted-by-mistake.pem"
    pem.write_text("not a certificate\n")
    message = refusal(mongodb_uri=scheme + rest.format(pem=pem))
    assert "MONGODB_URI" in message
    assert why in message
    assert "s3cret" not in message
    assert str(pem) not in message


@pytest.mark.parametrize("setting", ["jwt_issuer", "jwt_audience"])
@pytest.mark.parametrize("blank", ["", " ", "\t"], ids=["empty", "a-space", "a-tab"])
def test_a_blank_jwt_issuer_or_audience_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, setting: str, blank: str
) -> None:
    """`AGENT_STORE_JWT_ISSUER=${ISSUER}` with ISSUER unset: no real user token would match
    (a token with an empty `iss` would); the setting is at fault, not the tokens."""
    monkeypatch.setenv(f"AGENT_STORE_{setting.upper()}", blank)
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    assert str(caught.value).startswith(f"{setting}: ")


@pytest.mark.parametrize("bound", [1, 256, 4095])
def test_a_message_bound_that_would_cut_every_message_to_nothing_is_refused(bound: int) -> None:
    """A bound under a message's envelope and the truncation mark stores every message as
    `…[truncated]`, names and previews included."""
    message = refusal(max_message_bytes=bound)
    assert "max_message_bytes" in message
    assert "4096" in message
    assert Settings(max_message_bytes=4096).max_message_bytes == 4096


@pytest.mark.parametrize(
    ("host", "base"),
    [
        ("::1", "http://[::1]:8000"),
        ("::", "http://[::]:8000"),
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("localhost", "http://localhost:8000"),
    ],
)
def test_the_start_banner_brackets_an_ipv6_host_in_its_urls_as_uvicorn_does(
    host: str, base: str
) -> None:
    banner = start_banner(Settings(host=host), dev_token=None)
    urls = [word for line in banner for word in line.split() if word.startswith("http")]
    assert len(urls) > 3
    for url in urls:
        assert url.startswith(base)
        assert urllib.parse.urlsplit(url).port == 8000


def test_an_empty_jwt_algorithm_list_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_STORE_JWT_ALGORITHMS", "[]")
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    assert str(caught.value).startswith("jwt_algorithms: ")
    assert "AGENT_STORE_JWT_ISSUER" in str(caught.value)


@pytest.mark.parametrize(
    "proxies",
    [
        pytest.param(["127.0.0.0/33"], id="prefix-too-long"),
        pytest.param(["10.0.0.1/8"], id="host-bits-set"),
        pytest.param(["10.0.0.1", "proxy.internal"], id="host-name"),
        pytest.param([""], id="empty"),
        pytest.param(["10.0.0.1 "], id="trailing-space"),
        pytest.param(["*", "10.0.0.1"], id="star-among-others"),
    ],
)
def test_a_trusted_proxy_that_is_no_address_network_or_star_is_refused_naming_it(
    proxies: list[str],
) -> None:
    """uvicorn takes such an entry as a literal host name, which no client address is: the
    proxy's headers would be silently ignored (no secure cookie, the proxy's address in logs)."""
    message = refusal(trusted_proxies=proxies)
    assert "trusted_proxies" in message
    assert f"entry {len(proxies)}" in message or "`*`" in message
    for entry in proxies:
        if len(entry.strip()) > 1:
            assert entry.strip() not in message


@pytest.mark.parametrize(
    "proxies",
    [
        pytest.param(["*"], id="star"),
        pytest.param([], id="none"),
        pytest.param(["10.0.0.0/8", "192.168.1.7", "::1", "fd00::/8"], id="addresses-networks"),
    ],
)
def test_addresses_networks_or_a_lone_star_are_trusted_proxies(proxies: list[str]) -> None:
    assert Settings(trusted_proxies=proxies).trusted_proxies == proxies


def _a_file(tmp_path: Path) -> Path:
    taken = tmp_path / "taken"
    taken.write_text("not a directory")
    return taken


@pytest.mark.parametrize(
    ("where", "why"),
    [
        pytest.param(_a_file, "not a directory", id="a-file"),
        pytest.param(lambda tmp: _a_file(tmp) / "data", "cannot be created", id="under-a-file"),
    ],
)
def test_a_data_dir_the_embedded_server_cannot_use_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: Callable[[Path], Path], why: str
) -> None:
    monkeypatch.setenv("AGENT_STORE_DATA_DIR", str(where(tmp_path)))
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    assert str(caught.value).startswith("data_dir: ")
    assert why in str(caught.value)
    assert str(tmp_path) not in str(caught.value)


def test_a_data_dir_is_created_when_the_embedded_server_will_use_it(tmp_path: Path) -> None:
    data_dir = tmp_path / "a" / "b"
    serving_settings(Settings(data_dir=data_dir), demo_explicit=False)
    assert data_dir.is_dir()
    real = Settings(mongodb_uri="mongodb://db", service_tokens=[STRONG], data_dir=tmp_path / "no")
    serving_settings(real, demo_explicit=False)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize(
    ("setting", "env"),
    [
        pytest.param("host", {"AGENT_STORE_HOST": ""}, id="empty-host"),
        pytest.param(
            "runtime_context_start", {"AGENT_STORE_RUNTIME_CONTEXT_START": " "}, id="blank-marker"
        ),
        pytest.param(
            "MONGODB_URI",
            {
                "MONGODB_URI": "mongodb+srv://ada:s3cret@cluster.example.com:27017/",
                "AGENT_STORE_SERVICE_TOKENS": f'["{STRONG}"]',
            },
            id="srv-with-a-port",
        ),
        pytest.param(
            "MONGODB_URI",
            {
                "MONGODB_URI": "mongodb://ada:s3cret@127.0.0.1:9/?w=0&journal=true",
                "AGENT_STORE_SERVICE_TOKENS": f'["{STRONG}"]',
            },
            id="options-the-driver-refuses",
        ),
    ],
)
def test_python_m_app_refuses_an_unusable_setting_with_exit_2_before_it_serves(
    tmp_path: Path, setting: str, env: dict[str, str]
) -> None:
    finished = _run_app(env | {"AGENT_STORE_DATA_DIR": str(tmp_path), "AGENT_STORE_PORT": "18799"})
    assert finished.returncode == 2
    assert finished.stderr.startswith(f"invalid configuration: {setting}: ")
    assert "Traceback" not in finished.stderr
    assert "Serving on" not in finished.stdout
    assert "s3cret" not in finished.stdout + finished.stderr


def test_python_m_app_refuses_a_data_dir_naming_a_file_with_exit_2_and_no_traceback(
    tmp_path: Path,
) -> None:
    finished = _run_app({"AGENT_STORE_DATA_DIR": str(_a_file(tmp_path))})
    assert finished.returncode == 2
    assert finished.stderr.startswith("invalid configuration: data_dir: ")
    assert "Traceback" not in finished.stderr


@pytest.mark.parametrize("host", ["[::1]", "[::]"])
def test_a_bracketed_ipv6_host_is_refused_naming_the_spelling_to_use(host: str) -> None:
    """A URL's spelling of an IPv6 address, which no socket binds: the start stopped at bind
    (exit 3) after a banner printing `http://[[::1]]:…`."""
    message = refusal(host=host)
    assert "host" in message.lower()
    assert "::1, not [::1]" in message


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("AGENT_STORE_RUNTIME_CONTEXT_START", "<ctx>"),
        ("AGENT_STORE_RUNTIME_CONTEXT_END", "</ctx>"),
        ("agent_store_runtime_context_start", "<ctx>"),
    ],
)
def test_a_runtime_context_marker_set_without_the_other_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """`<ctx>` with the default end marker: no end in the text, the block never closes and
    every user message carrying context is stored with none of the user's words."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError) as caught:
        settings_from_environment()
    said = str(caught.value)
    assert said.startswith("runtime_context_start and runtime_context_end: ")
    assert "AGENT_STORE_RUNTIME_CONTEXT_START and AGENT_STORE_RUNTIME_CONTEXT_END" in said
    assert value not in said


@pytest.mark.parametrize(
    "environment",
    [
        {"AGENT_STORE_RUNTIME_CONTEXT_START": "[RUNTIME CONTEXT]"},
        {"AGENT_STORE_RUNTIME_CONTEXT_END": "[/RUNTIME CONTEXT]"},
    ],
)
def test_a_runtime_context_marker_set_alone_to_its_default_is_accepted(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str]
) -> None:
    """A values file spelling out a default: the markers are the defaults, the end comes."""
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    settings, _ = settings_from_environment()
    markers = settings.turn_rules().markers
    assert (markers.start, markers.end) == ("[RUNTIME CONTEXT]", "[/RUNTIME CONTEXT]")


def test_runtime_context_markers_set_together_are_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENT_STORE_RUNTIME_CONTEXT_START", "<ctx>")
    monkeypatch.setenv("AGENT_STORE_RUNTIME_CONTEXT_END", "</ctx>")
    settings, _ = settings_from_environment()
    assert settings.turn_rules().markers.end == "</ctx>"


@pytest.mark.parametrize(
    ("values", "missing", "other"),
    [
        pytest.param({"jwt_public_key": _rsa_public_pem()}, "jwt_secret", "jwt_public_key",
                     id="rsa-key-with-hs256"),
        pytest.param({"jwt_algorithms": ["RS256"], "jwt_secret": STRONG}, "jwt_public_key",
                     "jwt_secret", id="hmac-secret-with-rs256"),
        pytest.param({}, "jwt_secret", None, id="no-key-hs256"),
        pytest.param({"jwt_algorithms": ["RS512"]}, "jwt_public_key", None, id="no-key-rs512"),
    ],
)  # fmt: skip
def test_a_jwt_issuer_without_the_key_its_algorithms_verify_with_is_refused_naming_it(
    values: dict[str, Any], missing: str, other: str | None
) -> None:
    """Else every user token is 401 "no JWT key or issuer configured", though both are."""
    message = refusal(jwt_issuer="https://id.example", **values)
    assert f"{missing}: " in message
    assert "jwt_algorithms" in message
    if other is not None:
        assert other in message
    assert STRONG not in message
    assert "BEGIN PUBLIC KEY" not in message


def test_a_jwt_issuer_with_the_key_of_its_algorithms_is_accepted() -> None:
    Settings(jwt_issuer="https://id.example", jwt_secret=STRONG)
    pem = _rsa_public_pem()
    Settings(jwt_issuer="https://id.example", jwt_algorithms=["RS256"], jwt_public_key=pem)
    Settings(jwt_algorithms=["RS256"], jwt_secret=STRONG)  # no issuer: user tokens refused


@pytest.mark.parametrize("bound", [MAX_MESSAGE_BYTES + 1, 16 * 1_048_576, 64 * 1_048_576])
def test_a_message_bound_mongodb_would_refuse_documents_at_is_refused(bound: int) -> None:
    message = refusal(max_message_bytes=bound)
    assert "max_message_bytes" in message
    assert str(MAX_MESSAGE_BYTES) in message
    assert Settings(max_message_bytes=MAX_MESSAGE_BYTES).max_message_bytes == MAX_MESSAGE_BYTES


def test_a_message_cut_to_the_highest_bound_is_a_document_mongodb_takes() -> None:
    """The document as the store inserts it (`seq`, the longest `user_id`, `epoch`, blob ids
    naming the epoch) of a message cut to the highest bound is within MongoDB's 16 MiB."""
    rules = TurnRules(max_message_bytes=MAX_MESSAGE_BYTES)
    call = {
        "id": "c" * 64,
        "type": "function",
        "function": {"name": "f" * 64, "arguments": "a" * 9_000_000},
    }
    turn = [{"role": "assistant", "content": "é" * 9_000_000, "tool_calls": [call]}]
    plan = plan_turn("c" * 200, turn, rules=rules).for_epoch("e" * 16)
    assert plan.documents[0]["truncated"]
    stored = {**plan.documents[0], "seq": Int64(2**62), "user_id": "u" * 200, "epoch": "e" * 16}
    assert MAX_MESSAGE_BYTES - 4096 < len(bson.encode(plan.documents[0])) <= MAX_MESSAGE_BYTES
    assert len(bson.encode(stored)) <= MONGODB_MAX_DOCUMENT_BYTES


@pytest.mark.parametrize(
    "token",
    [
        pytest.param("prod-tökén-0123456789abcdef0123456789", id="latin-1"),
        pytest.param("prod-€uro-0123456789abcdef0123456789", id="beyond-latin-1"),
        pytest.param("prod-\u00a0-0123456789abcdef0123456789", id="no-break-space"),
    ],
)
def test_a_service_token_that_is_not_visible_ascii_is_refused_without_being_echoed(
    token: str,
) -> None:
    """HTTP headers are bytes read as Latin-1: such a token cannot be presented as sent."""
    for values in ({"service_tokens": [STRONG, token]}, {"named_service_tokens": {"ui": token}}):
        message = refusal(**values)
        assert "ASCII" in message
        assert token not in message
