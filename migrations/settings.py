"""What the migration reads of the service's settings: how turns are stored, and where.

A run converts legacy turns, and `verify` and `finish` compare them, by the rules the
service logs and serves turns with (its read fallback converts the same legacy turns): the
runtime context markers, the message bound and the name length. It works on the database
the service serves: its connection string, database and data directory. So the migration
reads them from the same environment variables (`AGENT_STORE_RUNTIME_CONTEXT_START`,
`MONGODB_URI`, …), as the service reads them (pydantic-settings, names in any case, an
empty value a value), through the library's one definition of them (`TurnSettings`,
`DatabaseSettings`, which `app.settings.Settings` is made of too), and a value the service's
start refuses stops every command as misuse (exit 2), before it looks for a database.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from agent_store.core import describe_validation_error
from agent_store.store import DatabaseSettings, TurnRules, TurnSettings
from migrations.errors import Misuse

SERVICE_DEFAULTS = TurnRules()
"""The rules of a service none of whose turn settings is set."""


class ServiceEnvironment(BaseSettings, TurnSettings, DatabaseSettings):
    """The turn and database settings, read from the environment as the service reads them."""

    # As `app.settings.Settings` reads the environment: the same prefix, names in any case,
    # the rest ignored.
    model_config = SettingsConfigDict(
        env_prefix="AGENT_STORE_", case_sensitive=False, extra="ignore", hide_input_in_errors=True
    )


def service_environment() -> ServiceEnvironment:
    """The settings the service reads, as the environment sets them; Misuse naming the
    setting (never its value) for one the service's start refuses."""
    try:
        return ServiceEnvironment()
    except ValidationError as exc:
        raise Misuse(describe_validation_error(exc, subject="configuration")) from None


def as_recorded(rules: TurnRules) -> dict[str, Any]:
    """The rules as a run's record keeps them (`options.rules`): the settings they are made
    of, by their names in `TurnSettings`."""
    return {
        "runtime_context_start": rules.markers.start,
        "runtime_context_end": rules.markers.end,
        "max_message_bytes": rules.max_message_bytes,
        "name_chars": rules.name_chars,
    }


def settings_differing(rules: TurnRules, *recorded: Mapping[str, Any]) -> list[str]:
    """The environment variables of the settings `rules` differ in from any of those
    `recorded` (`as_recorded`), in their order there; names only, never a value."""
    now = as_recorded(rules)
    return [
        f"AGENT_STORE_{name.upper()}"
        for name in now
        if any(earlier.get(name) != now[name] for earlier in recorded)
    ]
