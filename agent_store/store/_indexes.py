"""The store's collections and their indexes, created idempotently at start-up."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from bson import Int64
from pymongo import ASCENDING, DESCENDING, TEXT, IndexModel

from agent_store.core import epoch_millis
from agent_store.store._driver import Database, storage_errors

MESSAGES = "agent_messages"
CONVERSATIONS = "agent_conversations"
DELETIONS = "agent_deletions"
"""Deletions and erasures in progress (`DeletionRecords`): empty but while one runs or after
one failed part-way, so no index."""
BLOB_BUCKET = "agent_message_blobs"
"""The GridFS bucket of whole texts of cut messages (collections `….files`, `….chunks`)."""
BLOB_FILES = f"{BLOB_BUCKET}.files"
BLOB_CHUNKS = f"{BLOB_BUCKET}.chunks"
LANGGRAPH_CHECKPOINTS = "langgraph_checkpoints"
"""The LangGraph checkpointer's collection (`agent_store.integrations.langgraph`)."""
LANGGRAPH_TURN = "lg-"
"""How the turn ids the LangGraph checkpointer logs a checkpoint's messages under begin: the
checkpoint refers to them, or will once its document, written after them, is stored."""


def checkpoints_referring_to(conversation_id: str, seq: int) -> dict[str, Any]:
    """The query of the LangGraph checkpoint documents of a conversation whose messages refer to
    its message `seq`: a range `{from, to}` of `messages.segments` holds it (see
    `agent_store.integrations._langgraph_documents.encode_segments`)."""
    held = {"from": {"$lte": seq}, "to": {"$gt": seq}}
    return {"thread_id": conversation_id, "messages.segments": {"$elemMatch": held}}


THREAD_COLLECTIONS: tuple[str, ...] = (LANGGRAPH_CHECKPOINTS,)
"""Collections integrations keep beside the conversations (their indexes are theirs): each
document names its conversation as `thread_id`, when it has one the user it was written for
as `user_id`, and which conversation under that id it was written for as `THREAD_CONVERSATION`.
Deleting a conversation deletes its documents there (its owner's or no user's, of that
conversation or of none named), erasing a user deletes the documents of the user's
conversations (the user's or no user's) and every one naming the user, and a claim moves them
with the conversations, as it moves the messages."""
THREAD_CONVERSATION = "conversation_created_ms"
"""The field naming the conversation a document beside it was written for: its creation time
in milliseconds (`conversation_mark`). An id deleted and taken again is another conversation;
documents stored before they named it have none."""


def conversation_mark(created_at: datetime) -> Int64:
    """The conversation a thread's documents and cached messages belong to, as stored: its
    creation time in whole milliseconds (what a BSON date keeps of it, read back or not)."""
    return Int64(epoch_millis(created_at))


SHARD_KEYS: dict[str, dict[str, Any]] = {
    MESSAGES: {"conversation_id": 1, "seq": 1},
    CONVERSATIONS: {"_id": "hashed"},
}
"""The shard keys docs/SCALING.md recommends; the sharding contract test holds the store to them.

Messages: a transcript is one range of the key, a turn one insert on one shard.
Conversations: every single-document operation names `_id`; `user_id` is not in
the key because claims change it for many documents at once.
"""

TEXT_INDEX = "user_id_1_search_text_text"

INDEXES: dict[str, list[IndexModel]] = {
    MESSAGES: [
        IndexModel([("conversation_id", ASCENDING), ("seq", ASCENDING)], unique=True),
        IndexModel([("user_id", ASCENDING)]),
        # Compound on the owner first: a search reads one user's postings, not everyone's.
        IndexModel(
            [("user_id", ASCENDING), ("search_text", TEXT)],
            name=TEXT_INDEX,
            default_language="none",
        ),
    ],
    CONVERSATIONS: [
        IndexModel([("user_id", ASCENDING), ("updated_at", DESCENDING), ("_id", DESCENDING)]),
        # Every user's conversations, most recent first (the viewer's landing page).
        IndexModel([("updated_at", DESCENDING), ("_id", DESCENDING)]),
    ],
    # The two indexes GridFS drivers expect on a bucket.
    BLOB_FILES: [
        IndexModel([("filename", ASCENDING), ("uploadDate", ASCENDING)]),
        # A conversation's files, found without its messages (deleting or erasing it).
        IndexModel([("metadata.conversation_id", ASCENDING)]),
    ],
    BLOB_CHUNKS: [IndexModel([("files_id", ASCENDING), ("n", ASCENDING)], unique=True)],
}
"""Every index the store relies on, by collection."""


def _outdated_text_indexes(existing: list[dict[str, Any]]) -> list[str]:
    """Text indexes other than ours (a collection holds one): earlier versions' to replace."""

    def is_text(key: list[tuple[str, Any]]) -> bool:
        # MongoDB lists a text index's key as `_fts`/`_ftsx`; some servers as `field: "text"`.
        return any(field == "_fts" or kind == "text" for field, kind in key)

    return [
        index["name"]
        for index in existing
        if index["name"] != TEXT_INDEX and is_text(list(index.get("key", [])))
    ]


async def create_indexes(db: Database) -> None:
    """Create every index of `INDEXES` on an async handle. Existing indexes are kept."""
    with storage_errors("create indexes"):
        existing = await db[MESSAGES].index_information()
        for name in _outdated_text_indexes([{"name": k, **v} for k, v in existing.items()]):
            await db[MESSAGES].drop_index(name)
        for collection, models in INDEXES.items():
            await db[collection].create_indexes(models)


def create_indexes_sync(db: Any) -> None:
    """The same indexes through a synchronous PyMongo `Database` (the migration tool's)."""
    with storage_errors("create indexes"):
        existing = db[MESSAGES].index_information()
        for name in _outdated_text_indexes([{"name": k, **v} for k, v in existing.items()]):
            db[MESSAGES].drop_index(name)
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
