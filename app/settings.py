"""Service settings, read once from the environment at start-up."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, PositiveInt
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.text import RuntimeContextMarkers
from app.truncation import DEFAULT_MAX_MESSAGE_BYTES
from app.turns import TurnRules


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
    max_message_bytes: PositiveInt = DEFAULT_MAX_MESSAGE_BYTES
    runtime_context_start: str = "[RUNTIME CONTEXT]"
    runtime_context_end: str = "[/RUNTIME CONTEXT]"
    name_chars: PositiveInt = 60
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
