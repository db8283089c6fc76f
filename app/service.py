"""The running service's resources: the database connection and the store objects."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from bson.codec_options import DatetimeConversion
from pymongo import AsyncMongoClient
from pymongo.monitoring import CommandListener

from agent_store.embedded import URI_FILE, embedded_mongodb
from agent_store.legacy import LegacyTurns
from agent_store.store import (
    AgentMessageLogger,
    ConversationStore,
    Database,
    client_options,
    storage_errors,
)
from app.settings import Settings


@dataclass(frozen=True)
class Store:
    """What request handlers use: the logger and the conversation store on one database."""

    logger: AgentMessageLogger
    conversations: ConversationStore
    legacy: LegacyTurns
    """The legacy turns (the viewer shows them, and links to them where a conversation has
    some)."""
    db: Database = None
    """The database itself, for what has no store method (viewer sessions, demo data)."""

    @classmethod
    def on(cls, db: Database, settings: Settings) -> Store:
        """The logger and the store on `db`, with the legacy turns wired as `settings` say."""
        rules = settings.turn_rules()
        legacy = LegacyTurns(
            db,
            rules=rules,
            read_fallback=settings.legacy_read_fallback,
            dual_write=settings.legacy_dual_write,
        )
        return cls(
            # Legacy turns observe logged turns only to write them twice (dual write).
            logger=AgentMessageLogger(
                db, rules=rules, observers=[legacy] if legacy.dual_write else [], legacy=legacy
            ),
            conversations=ConversationStore(db, legacy=legacy, rules=rules),
            db=db,
            legacy=legacy,
        )


@asynccontextmanager
async def open_store(
    settings: Settings, *, command_listeners: Sequence[CommandListener] = ()
) -> AsyncIterator[Store]:
    """Connect (starting the embedded server when no URI is set) and prepare the indexes.

    `command_listeners` see every command the client sends (tracing).
    """
    async with AsyncExitStack() as stack:
        uri = settings.mongodb_uri or await stack.enter_async_context(
            embedded_mongodb(settings.data_dir)
        )
        if settings.mongodb_uri is None:
            logging.getLogger("agent_store.embedded").info(
                "embedded database at %s, published in %s for `make migrate`",
                uri,
                settings.data_dir / URI_FILE,
            )
        client: AsyncMongoClient[dict[str, object]] = AsyncMongoClient(
            uri,
            tz_aware=True,
            # A legacy date outside Python's range (year 0, 55840) reads as a `DatetimeMS`.
            datetime_conversion=DatetimeConversion.DATETIME_AUTO,
            serverSelectionTimeoutMS=10_000,
            event_listeners=list(command_listeners),
            **client_options(uri),
        )
        stack.push_async_callback(client.close)
        with storage_errors("connect to the database"):
            await client.admin.command("ping")
        store = Store.on(client[settings.database], settings)
        await store.logger.ensure_indexes()
        yield store
