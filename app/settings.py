"""Service settings, read once from the environment at start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, PositiveInt, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from agent_store.store import DEFAULT_MAX_MESSAGE_BYTES, RuntimeContextMarkers, TurnRules

JwtAlgorithm = Literal["HS256", "HS384", "HS512", "RS256", "RS384", "RS512"]


def _hs256_only() -> list[JwtAlgorithm]:
    return ["HS256"]


class Settings(BaseSettings):
    """Every setting; environment variables are prefixed `AGENT_STORE_` unless noted."""

    model_config = SettingsConfigDict(env_prefix="AGENT_STORE_", extra="ignore")

    mongodb_uri: str | None = Field(
        default=None, validation_alias=AliasChoices("MONGODB_URI", "AGENT_STORE_MONGODB_URI")
    )
    """A MongoDB connection string (`MONGODB_URI`). Unset: start the embedded server."""
    database: str = "agent_store"
    data_dir: Path = Path("data")
    """Where the embedded server keeps its SQLite file."""
    host: str = "127.0.0.1"
    port: PositiveInt = 8000
    service_tokens: list[str] = Field(default_factory=list)
    """Bearer tokens accepted from services (a JSON list in the environment)."""
    named_service_tokens: dict[str, str] = Field(default_factory=dict)
    """More bearer tokens, by the service's name (a JSON object); audit lines name the service."""
    jwt_algorithms: list[JwtAlgorithm] = Field(default_factory=_hs256_only)
    """The only algorithms accepted for `X-User-JWT`; all HMAC or all RSA, never both."""
    jwt_secret: SecretStr | None = None
    """The shared secret of HMAC user tokens."""
    jwt_public_key: str | None = None
    """The PEM public key of RSA user tokens."""
    jwt_audience: str = "agent-store"
    jwt_issuer: str | None = None
    """Required `iss` of user tokens; user tokens are refused while it is unset."""
    max_request_bytes: PositiveInt = 1_048_576 + 65_536
    """Request bodies over this are refused with 413 (a 1 MiB message plus its envelope)."""
    max_turn_bytes: PositiveInt = 16 * 1_048_576
    """The cap for a turn posted to be logged. Larger than `max_request_bytes` because a
    turn may carry big tool results or parsed uploads: the logger stores them truncated
    to `max_message_bytes` each rather than losing the turn."""
    demo_data: bool = False
    """Load demo conversations at start-up when the store is empty (`python -m app` sets it)."""

    @model_validator(mode="after")
    def _one_jwt_family(self) -> Settings:
        families = {algorithm[:2] for algorithm in self.jwt_algorithms}
        if len(families) > 1:
            raise ValueError(
                "jwt_algorithms mixes HMAC (HS*) and RSA (RS*) algorithms; pick one family "
                "so a public key can never be used as an HMAC secret"
            )
        return self

    max_message_bytes: PositiveInt = DEFAULT_MAX_MESSAGE_BYTES
    runtime_context_start: str = "[RUNTIME CONTEXT]"
    runtime_context_end: str = "[/RUNTIME CONTEXT]"
    name_chars: int = Field(default=60, ge=2, le=200)
    """The longest automatic conversation name, ellipsis included (a name holds at most 200)."""
    legacy_dual_write: bool = False
    """Also keep each logged turn as a legacy turn document (`AGENT_STORE_LEGACY_DUAL_WRITE`),
    so the old service can take over again during the migration's rollback window."""
    legacy_read_fallback: bool = True
    """Serve conversations not migrated yet from the legacy turns (`…_LEGACY_READ_FALLBACK`)."""

    def turn_rules(self) -> TurnRules:
        return TurnRules(
            markers=RuntimeContextMarkers(self.runtime_context_start, self.runtime_context_end),
            max_message_bytes=self.max_message_bytes,
            name_chars=self.name_chars,
        )
