"""The settings of which database the store works on, one definition for every edge.

The service (`app.settings.Settings`) and the migration (`python -m migrations`) read them
from the same environment variables (`MONGODB_URI`, `AGENT_STORE_DATABASE`, …) by these
definitions, so the migration works on the database the service serves, or stops where the
service's start stops. The service checks a connection string further (whether the driver
builds a client from it); the library itself reads no environment variable.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from agent_store.store._driver import database_name_refusal

MONGODB_SCHEMES = ("mongodb://", "mongodb+srv://")


class DatabaseSettings(BaseModel):
    """Where the store's collections are: a connection string, else the embedded server."""

    # Each field's docstring is its description in docs/CONFIGURATION.md.
    model_config = ConfigDict(use_attribute_docstrings=True, hide_input_in_errors=True)

    mongodb_uri: str | None = Field(
        default=None, validation_alias=AliasChoices("MONGODB_URI", "AGENT_STORE_MONGODB_URI")
    )
    """A MongoDB connection string (`MONGODB_URI`: `mongodb://`, or `mongodb+srv://` with one
    host and no port, its servers found in DNS when connecting). One that does not parse,
    or whose client the driver refuses to build (options that contradict each other, such as
    `w=0` with `journal=true`; a TLS file that cannot be read or is not PEM), stops the
    start, told without DNS or network; so does an empty one (unset it for the embedded
    server). Unset: start the embedded server."""
    database: str = "agent_store"
    """The database holding the store's collections (a name MongoDB accepts: 1 to 63 bytes,
    none of `/\\. "$`)."""
    data_dir: Path = Path("data")
    """Where the embedded server keeps its SQLite file; created at start when `MONGODB_URI` is
    unset. One that cannot be (a file, a path under a file, no permission) stops the start."""

    @field_validator("mongodb_uri")
    @classmethod
    def _connection_string_scheme(cls, uri: str | None) -> str | None:
        # `MONGODB_URI=${MONGODB_URI}` with it unset is empty, not unset: refused, never
        # taken for the embedded server's database.
        if uri is not None and not uri.startswith(MONGODB_SCHEMES):
            raise ValueError(
                f"a MongoDB connection string starts with {' or '.join(MONGODB_SCHEMES)}"
            )
        return uri

    @field_validator("database")
    @classmethod
    def _database_name(cls, name: str) -> str:
        why = database_name_refusal(name)
        if why is not None:
            raise ValueError(why)
        return name
