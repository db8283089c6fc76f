"""Collection names, their indexes, and the database handles the store accepts."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import ASCENDING, DESCENDING, TEXT

from app.errors import storage_errors

MESSAGES = "agent_messages"
CONVERSATIONS = "agent_conversations"
LEGACY_TURNS = "agent_conversations_deprecated"
SESSION_HITL = "session_hitl"

Database = Any
"""A PyMongo `AsyncDatabase`, a Motor `AsyncIOMotorDatabase` or a mongomock-motor database.

They share the awaitable collection API the store uses, but no common type.
"""

INDEXES: dict[str, list[tuple[list[tuple[str, Any]], dict[str, Any]]]] = {
    MESSAGES: [
        ([("conversation_id", ASCENDING), ("seq", ASCENDING)], {"unique": True}),
        ([("user_id", ASCENDING)], {}),
        ([("search_text", TEXT)], {"default_language": "none"}),
    ],
    CONVERSATIONS: [
        ([("user_id", ASCENDING), ("updated_at", DESCENDING), ("_id", DESCENDING)], {}),
    ],
}


async def create_indexes(db: Database) -> None:
    """Create every index the store relies on. Idempotent: existing indexes are kept."""
    with storage_errors("create indexes"):
        for collection, specs in INDEXES.items():
            for keys, options in specs:
                await db[collection].create_index(keys, **options)


class IndexSetup:
    """Creates the indexes once per handle; a failed attempt is retried on the next call."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._done = False
        self._lock = asyncio.Lock()

    async def ensure(self) -> None:
        if self._done:
            return
        async with self._lock:
            if not self._done:
                await create_indexes(self._db)
                self._done = True
