"""Service settings, read once from the environment at start-up."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from pydantic import (
    Field,
    PositiveInt,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict
from pymongo import MongoClient
from pymongo.errors import ConfigurationError as DriverConfigurationError
from pymongo.errors import InvalidURI
from pymongo.uri_parser import parse_uri, split_options

from agent_store.core import describe_validation_error
from agent_store.store import DatabaseSettings, TurnSettings

JwtAlgorithm = Literal["HS256", "HS384", "HS512", "RS256", "RS384", "RS512"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
MetricsExposure = Literal["public", "token", "off"]
MIN_SERVICE_TOKEN_CHARS = 32
HMAC_KEY_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}
"""RFC 7518 §3.2: an HMAC key at least as long as the hash it signs with."""
JWT_FAMILY_KEYS = {
    "HS": ("jwt_secret", "jwt_public_key", "RS256"),
    "RS": ("jwt_public_key", "jwt_secret", "HS256"),
}
"""By an algorithm family: the setting of its key, the other family's, an algorithm of it."""
TcpPort = Annotated[int, Field(ge=1, le=65535)]
SRV_SCHEME = "mongodb+srv://"
SRV_ONLY = frozenset({"srvservicename", "srvmaxhosts"})
"""Options the driver takes in a `mongodb+srv://` string alone (lower case)."""
TLS_FILE_REFUSED = (
    "a TLS file it names (tlsCAFile, tlsCertificateKeyFile) cannot be read or does not load as PEM"
)


class ConfigurationError(ValueError):
    """The settings are valid one by one, but the service must not start with them."""


def _check_service_token(token: str) -> str:
    # Never repeat the token in the message: it ends up in logs. Visible ASCII only: a
    # header's bytes are read as Latin-1 and the token compared as UTF-8, so a token with
    # any other character matches no request (one beyond Latin-1 cannot even be sent).
    if len(token) < MIN_SERVICE_TOKEN_CHARS or not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"a service token must have at least {MIN_SERVICE_TOKEN_CHARS} characters, each "
            "visible ASCII (no space, control character or letter outside ASCII, which no "
            f"client sends as written); one configured token has {len(token)} characters or "
            "another character"
        )
    return token


def _address_or_network(entry: str) -> bool:
    """Whether uvicorn reads `entry` as an IP address or a network (strictly: no host bits)."""
    try:
        if "/" in entry:
            ipaddress.ip_network(entry)
        else:
            ipaddress.ip_address(entry)
    except ValueError:
        return False
    return True


def _connection_string_refusal(uri: str) -> str | None:
    """Why the driver would refuse `uri` when connecting, told without a DNS lookup; None when
    it would not. Never the driver's words: they may quote the URI, password included.

    A `mongodb+srv://` string names one host and no port (DNS gives the servers and their
    ports when connecting): the rest is read as the driver reads it, its credentials, host
    and database as the same `mongodb://` string's, its options each (`split_options`).
    Then the options together, as the driver builds its client from them (`_client_refusal`)."""
    srv = uri.startswith(SRV_SCHEME)
    address, _, options = uri.removeprefix(SRV_SCHEME).partition("?") if srv else (uri, "", "")
    try:
        parsed = parse_uri("mongodb://" + address, default_port=None) if srv else parse_uri(uri)
        named = split_options(options) if options else {}
    except (InvalidURI, DriverConfigurationError, ValueError):
        return "it is not a valid MongoDB connection string"
    except OSError:  # the driver reads the TLS files it names as it parses the string
        return TLS_FILE_REFUSED
    if srv and (len(parsed["nodelist"]) != 1 or parsed["nodelist"][0][1] is not None):
        return (
            f"a {SRV_SCHEME} connection string names one host and no port (DNS names the "
            "servers and their ports); list several hosts or a port with mongodb://"
        )
    contradiction = _srv_contradiction(named) if srv else None
    return contradiction or _client_refusal(_srv_stand_in(address, options) if srv else uri)


def _srv_stand_in(address: str, options: str) -> str:
    """The `mongodb://` string a `mongodb+srv://` one builds its client as, without DNS:
    the same host, credentials and options, TLS on unless told (as for every SRV string),
    less the options only SRV takes (`srvServiceName`, `srvMaxHosts`)."""
    kept = [o for o in re.split("[&;]", options) if o.partition("=")[0].lower() not in SRV_ONLY]
    if not any(o.partition("=")[0].lower() in {"tls", "ssl"} for o in kept):
        kept.append("tls=true")
    return "mongodb://" + address + "?" + "&".join(o for o in kept if o)


def _client_refusal(uri: str) -> str | None:
    """Why the driver would refuse to build its client from `uri` (options that contradict
    each other, a TLS file that does not load), told by building one that never connects."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the service's own client warns as it starts
            MongoClient(uri, connect=False).close()
    except OSError:  # ssl.SSLError too: a file that is not PEM
        return TLS_FILE_REFUSED
    except (DriverConfigurationError, ValueError, TypeError) as refused:
        if isinstance(refused.__cause__ or refused.__context__, OSError):
            return TLS_FILE_REFUSED  # a certificate and key file that does not load
        return (
            "the driver refuses its options together (such as w=0 with journal=true, "
            "readPreference=primary with tags, an authMechanism given a user or password it "
            "does not take, or TLS files with tls=false)"
        )
    return None


def _srv_contradiction(named: Mapping[str, Any]) -> str | None:
    """Which options of a `mongodb+srv://` string contradict each other, as the driver tells
    once DNS gave the servers (options DNS adds cannot be told here); None when none do."""
    if named.get("directConnection"):
        return f"a {SRV_SCHEME} connection string cannot ask for directConnection=true"
    if named.get("loadBalanced") and named.get("replicaSet"):
        return "loadBalanced=true cannot be given with replicaSet"
    if named.get("srvMaxHosts") and (named.get("loadBalanced") or named.get("replicaSet")):
        return "srvMaxHosts cannot be given with loadBalanced=true or replicaSet"
    return None


def _hs256_only() -> list[JwtAlgorithm]:
    return ["HS256"]


def _loopback_only() -> list[str]:
    return ["127.0.0.1"]


class Settings(BaseSettings, TurnSettings, DatabaseSettings):
    """Every setting; environment variables are prefixed `AGENT_STORE_` unless noted. Those
    of how turns are stored (`TurnSettings`: markers, message bound, name length) and of
    which database (`DatabaseSettings`: connection string, database, data directory) are the
    library's definitions, which `python -m migrations` reads the same environment with."""

    # Inputs stay out of error messages: a refused token or secret must not reach a log.
    # Each field's docstring is its description in docs/CONFIGURATION.md (scripts/configuration.py).
    model_config = SettingsConfigDict(
        env_prefix="AGENT_STORE_",
        extra="ignore",
        hide_input_in_errors=True,
        use_attribute_docstrings=True,
        # Lists and objects are decoded by `_json_text` below, so a value that is not JSON is
        # refused as any other bad value is, naming its setting.
        enable_decoding=False,
    )

    host: str = "127.0.0.1"
    """The address `python -m app` binds (`0.0.0.0` for every interface, in a container).
    Empty or white space alone stops the start: asyncio would bind every interface. An IPv6
    address is given without brackets (`::1`)."""
    port: TcpPort = 8000
    """The port `python -m app` listens on (1 to 65535)."""
    workers: PositiveInt = 1
    """Worker processes of `python -m app`; more than one needs `MONGODB_URI` (the embedded
    server belongs to one process: a second worker of uvicorn's or gunicorn's `--workers`
    without it is refused as it starts)."""
    trusted_proxies: list[str] = Field(default_factory=_loopback_only)
    """Addresses (or networks with no host bits set, such as `10.0.0.0/8`, or `*` alone) of
    proxies whose `X-Forwarded-For` and `X-Forwarded-Proto` are believed: the client address
    (sign-in limits, logs) and the scheme (secure cookies) come from them. A JSON list; an
    entry that is none of these (a host name, `10.0.0.0/33`) stops the start."""
    log_level: LogLevel = "info"
    """The lowest level logged: `debug`, `info`, `warning`, `error` or `critical`."""
    expose_openapi: bool = True
    """Serve `/openapi.json` without a token."""
    expose_docs: bool = True
    """Serve the interactive API page at `/docs` (Swagger UI from the `swagger-ui-bundle-v2`
    package's files, no CDN); needs `expose_openapi`."""
    metrics: MetricsExposure = "public"
    """`/metrics` for Prometheus: `public` (no token), `token` (a service token) or `off`."""
    tracing: bool = False
    """Trace HTTP requests and MongoDB commands with OpenTelemetry (the `otel` extra), sent
    where the standard `OTEL_EXPORTER_OTLP_*` variables say."""
    service_tokens: list[str] = Field(default_factory=list)
    """Bearer tokens accepted from services (a JSON list in the environment): each at least
    32 characters of visible ASCII (no space, control character or letter outside ASCII)."""
    named_service_tokens: dict[str, str] = Field(default_factory=dict)
    """More bearer tokens, by the service's name (a JSON object); audit lines name the service."""
    jwt_algorithms: list[JwtAlgorithm] = Field(default_factory=_hs256_only)
    """The only algorithms accepted for `X-User-JWT` (at least one); all HMAC or all RSA,
    never both."""
    jwt_secret: SecretStr | None = None
    """The shared secret of HMAC user tokens."""
    jwt_public_key: str | None = None
    """The PEM public key of RSA user tokens; one that does not load stops the start."""
    jwt_audience: str = "agent-store"
    """Required `aud` of user tokens; empty or white space alone stops the start (no token
    would match)."""
    jwt_issuer: str | None = None
    """Required `iss` of user tokens; user tokens are refused while it is unset. Empty or
    white space alone stops the start: leave it unset to refuse user tokens. Set, it needs
    the key its algorithms verify with (`jwt_secret` for `HS*`, `jwt_public_key` for `RS*`),
    else the start stops."""
    max_request_bytes: PositiveInt = 1_048_576 + 65_536
    """Request bodies over this are refused with 413 (a 1 MiB message plus its envelope), but
    for the turns and steering deliveries `max_turn_bytes` caps."""
    max_turn_bytes: PositiveInt = 16 * 1_048_576
    """The cap for a turn posted to be logged, and for a message delivered into a running
    turn's steering inbox (a message as a turn's is). Larger than `max_request_bytes`
    because a turn may carry big tool results or parsed uploads: the logger stores them
    truncated to `max_message_bytes` each rather than losing the turn."""
    demo_data: bool = False
    """Load demo conversations at start-up when the store is empty (`python -m app` sets it)."""

    max_user_token_seconds: PositiveInt = 3600
    """The longest lifetime (`exp` - `iat`) of a user token accepted; longer ones are refused."""

    @field_validator(
        "trusted_proxies",
        "service_tokens",
        "named_service_tokens",
        "jwt_algorithms",
        mode="before",
    )
    @classmethod
    def _json_text(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):
            return value
        shape = "object" if info.field_name == "named_service_tokens" else "list"
        example = '{"name": "…"}' if shape == "object" else '["…"]'
        try:
            return json.loads(value)
        except ValueError:
            # Never the value: it may be a token.
            raise ValueError(f"must be a JSON {shape}, such as {example}") from None

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_addresses(cls, proxies: list[str]) -> list[str]:
        # uvicorn reads an entry that is no address or network as a host name, which no
        # client address is: the proxy's headers would be ignored without a word.
        if "*" in proxies and len(proxies) > 1:
            raise ValueError("`*` trusts every address: it must be the only entry")
        for number, entry in enumerate(proxies, start=1):
            if entry != "*" and not _address_or_network(entry):
                raise ValueError(
                    f"entry {number} is not an IP address, a network with no host bits set "
                    "(such as 10.0.0.0/8) or `*`"
                )
        return proxies

    @field_validator("host")
    @classmethod
    def _named_host(cls, host: str) -> str:
        # `AGENT_STORE_HOST=${HOST}` with HOST unset: asyncio binds every interface for "",
        # which only the explicit 0.0.0.0 (or ::) may ask for.
        if not host.strip():
            raise ValueError(
                "an empty address would listen on every interface; name one: 127.0.0.1 (the "
                "default, this machine only) or 0.0.0.0 (every interface)"
            )
        if "[" in host or "]" in host:  # a URL's spelling, which no socket binds
            raise ValueError("give an IPv6 address without brackets: ::1, not [::1]")
        return host

    @field_validator("jwt_audience", "jwt_issuer")
    @classmethod
    def _named_claim(cls, value: str | None, info: ValidationInfo) -> str | None:
        # `AGENT_STORE_JWT_ISSUER=${ISSUER}` with ISSUER unset: no real user token would
        # match, and a token with an empty claim would.
        if value is not None and not value.strip():
            unset = (
                "; leave it unset to refuse user tokens" if info.field_name == "jwt_issuer" else ""
            )
            raise ValueError(
                "empty or white space alone matches no token from a real issuer: name the "
                f"value your user tokens carry{unset}"
            )
        return value

    @field_validator("jwt_algorithms")
    @classmethod
    def _some_jwt_algorithm(cls, algorithms: list[JwtAlgorithm]) -> list[JwtAlgorithm]:
        if not algorithms:
            raise ValueError(
                'name at least one algorithm, such as ["HS256"]; to accept no user tokens, '
                "leave AGENT_STORE_JWT_ISSUER unset"
            )
        return algorithms

    @field_validator("mongodb_uri")
    @classmethod
    def _connection_string(cls, uri: str | None) -> str | None:
        # After the library's check of its scheme (`DatabaseSettings`), which the migration
        # reads the same variable by.
        why = _connection_string_refusal(uri) if uri is not None else None
        if why is not None:
            raise ValueError(why)
        return uri

    @field_validator("jwt_public_key")
    @classmethod
    def _loadable_public_key(cls, pem: str | None) -> str | None:
        if pem is not None:
            try:
                key = load_pem_public_key(pem.encode())
            except (ValueError, TypeError):
                key = None
            if not isinstance(key, RSAPublicKey):
                raise ValueError(
                    "it is not an RSA public key in PEM (-----BEGIN PUBLIC KEY----- …) that loads"
                )
        return pem

    @field_validator("service_tokens")
    @classmethod
    def _strong_tokens(cls, tokens: list[str]) -> list[str]:
        return [_check_service_token(token) for token in tokens]

    @field_validator("named_service_tokens")
    @classmethod
    def _strong_named_tokens(cls, tokens: dict[str, str]) -> dict[str, str]:
        for name, token in tokens.items():
            if not name.strip():
                raise ValueError("every named service token needs a name (audit lines show it)")
            _check_service_token(token)
        return tokens

    @model_validator(mode="after")
    def _one_jwt_family(self) -> Settings:
        families = {algorithm[:2] for algorithm in self.jwt_algorithms}
        if len(families) > 1:
            raise ValueError(
                "jwt_algorithms mixes HMAC (HS*) and RSA (RS*) algorithms; pick one family "
                "so a public key can never be used as an HMAC secret"
            )
        return self

    @model_validator(mode="after")
    def _key_of_the_algorithms(self) -> Settings:
        # With an issuer, user tokens are verified with the key the algorithms' family takes:
        # without it, every user token would be 401 though a key and an issuer are set.
        if self.jwt_issuer is None:
            return self
        needed, other, other_algorithm = JWT_FAMILY_KEYS[self.jwt_algorithms[0][:2]]
        if getattr(self, needed) is not None:
            return self
        given = (
            f"; {other} is set, the key of the other family: to verify with it, set "
            f"AGENT_STORE_JWT_ALGORITHMS='[\"{other_algorithm}\"]'"
            if getattr(self, other) is not None
            else ""
        )
        raise ValueError(
            f"{needed}: unset, but jwt_issuer is set and jwt_algorithms "
            f"({'/'.join(self.jwt_algorithms)}) verify user tokens with it{given}; or leave "
            "AGENT_STORE_JWT_ISSUER unset to refuse user tokens"
        )

    @model_validator(mode="after")
    def _strong_hmac_secret(self) -> Settings:
        needed = max((HMAC_KEY_BYTES.get(a, 0) for a in self.jwt_algorithms), default=0)
        if self.jwt_secret is None or not needed:
            return self
        size = len(self.jwt_secret.get_secret_value().encode())
        if size < needed:
            raise ValueError(
                f"jwt_secret has {size} bytes; {'/'.join(self.jwt_algorithms)} needs at least "
                f"{needed} bytes (RFC 7518 §3.2): use a random secret, e.g. 64 hex digits"
            )
        return self

    legacy_dual_write: bool = False
    """Also keep each logged turn as a legacy turn document, so the old service can take over
    again during the migration's rollback window."""
    legacy_read_fallback: bool = True
    """Serve conversations not migrated yet from the legacy turns."""

    @model_validator(mode="after")
    def _docs_need_the_schema(self) -> Settings:
        if self.expose_docs and not self.expose_openapi:
            raise ValueError(
                "expose_docs needs expose_openapi: the API page reads /openapi.json; "
                "set AGENT_STORE_EXPOSE_DOCS=false too"
            )
        return self


def serving_settings(settings: Settings, *, demo_explicit: bool) -> tuple[Settings, str | None]:
    """The settings `python -m app` serves with, and the development token it invented, if any.

    The embedded database gets its data directory created (ConfigurationError naming
    `data_dir` when it cannot be), demo data unless `demo_explicit` (the environment chose),
    and a random token when none is configured. A real database (`MONGODB_URI`) gets neither: it
    is refused without configured tokens rather than served behind a token printed to a log.
    """
    if settings.mongodb_uri is None and settings.workers > 1:
        raise ConfigurationError(
            f"AGENT_STORE_WORKERS is {settings.workers} but MONGODB_URI is unset: the embedded "
            "server belongs to one process; set MONGODB_URI to run several workers"
        )
    if settings.mongodb_uri is None:
        _embedded_data_dir(settings.data_dir)
        if not demo_explicit:
            settings = settings.model_copy(update={"demo_data": True})
    if settings.service_tokens or settings.named_service_tokens:
        return settings, None
    if settings.mongodb_uri is not None:
        raise ConfigurationError(
            "MONGODB_URI is set but no service token is configured: set "
            "AGENT_STORE_SERVICE_TOKENS (a JSON list of tokens of at least "
            f"{MIN_SERVICE_TOKEN_CHARS} characters) or AGENT_STORE_NAMED_SERVICE_TOKENS; "
            "a development token is only made up for the embedded database"
        )
    token = "dev-" + secrets.token_urlsafe(32)
    return settings.model_copy(update={"service_tokens": [token]}), token


def _embedded_data_dir(data_dir: Path) -> None:
    """Create the embedded server's directory, or raise ConfigurationError saying why it
    cannot be used (never the path: a refused value stays out of messages)."""
    why = None
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        why = "exists but is not a directory"
    except OSError as exc:
        why = f"cannot be created ({exc.strerror or type(exc).__name__})"
    else:
        if not os.access(data_dir, os.W_OK | os.X_OK):
            why = "is not writable by this process"
    if why is not None:
        raise ConfigurationError(
            f"data_dir: the embedded server's directory (AGENT_STORE_DATA_DIR) {why}; name a "
            "directory this process may create and write in, or set MONGODB_URI"
        )


def settings_from_environment() -> tuple[Settings, str | None]:
    """The settings a server process starts with (`python -m app`, `uvicorn --factory`).

    Raises ConfigurationError naming what is wrong (never the refused value).
    """
    try:
        settings = Settings()
    except ValidationError as exc:
        described = describe_validation_error(exc, subject="configuration")
        raise ConfigurationError(described.removeprefix("invalid configuration: ")) from None
    return serving_settings(settings, demo_explicit="AGENT_STORE_DEMO_DATA" in os.environ)


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """How `python -m app` runs uvicorn: bind address, workers, proxies, log level.

    uvicorn's access log stays off: the service writes one JSON line per request itself.
    """
    return {
        "host": settings.host,
        "port": settings.port,
        "workers": settings.workers,
        # Several workers import the factory each (`app.api:create_app`); one serves the app.
        "factory": settings.workers > 1,
        "proxy_headers": True,
        "forwarded_allow_ips": ",".join(settings.trusted_proxies),
        "log_level": settings.log_level,
        "access_log": False,
        "server_header": False,
    }
