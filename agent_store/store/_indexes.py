"""The store's collections and their indexes, created idempotently at start-up."""

from __future__ import annotations

import asyncio
from typing import Any

from pymongo import ASCENDING, DESCENDING, TEXT, IndexModel

from agent_store.store._driver import Database, storage_errors

MESSAGES = "agent_messages"
CONVERSATIONS = "agent_conversations"
BLOB_BUCKET = "agent_message_blobs"
"""The GridFS bucket of whole texts of cut messages (collections `….files`, `….chunks`)."""
BLOB_FILES = f"{BLOB_BUCKET}.files"
BLOB_CHUNKS = f"{BLOB_BUCKET}.chunks"

INDEXES: dict[str, list[IndexModel]] = {
    MESSAGES: [
        IndexModel([("conversation_id", ASCENDING), ("seq", ASCENDING)], unique=True),
        IndexModel([("user_id", ASCENDING)]),
        IndexModel([("search_text", TEXT)], default_language="none"),
    ],
    CONVERSATIONS: [
        IndexModel([("user_id", ASCENDING), ("updated_at", DESCENDING), ("_id", DESCENDING)]),
    ],
    # The two indexes GridFS drivers expect on a bucket.
    BLOB_FILES: [IndexModel([("filename", ASCENDING), ("uploadDate", ASCENDING)])],
    BLOB_CHUNKS: [IndexModel([("files_id", ASCENDING), ("n", ASCENDING)], unique=True)],
}
"""Every index the store relies on, by collection."""


async def create_indexes(db: Database) -> None:
    """Create every index of `INDEXES` on an async handle. Existing indexes are kept."""
    with storage_errors("create indexes"):
        for collection, models in INDEXES.items():
            await db[collection].create_indexes(models)


def create_indexes_sync(db: Any) -> None:
    """The same indexes through a synchronous PyMongo `Database` (the migration tool's)."""
    with storage_errors("create indexes"):
        for collection, models in INDEXES.items():
            db[collection].create_indexes(models)


class IndexSetup:
    """Creates the indexes once per handle; a failed attempt is retried on the next call."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._done = False
        self._lock = asyncio.Lock()

    async def ensure(self) -> None:
        """Create the indexes unless this handle already did."""
        if self._done:
            return
        async with self._lock:
            if not self._done:
                await create_indexes(self._db)
                self._done = True
