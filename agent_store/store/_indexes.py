"""The store's collections and their indexes, created idempotently at start-up."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
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


def checkpoints_referring_to(
    conversation_id: str, seq: int, conversation: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The query of the LangGraph checkpoint documents of a conversation whose messages refer to
    its message `seq`: a range `{from, to}` of `messages.segments` holds it (see
    `agent_store.integrations._langgraph_documents.encode_segments`). With the `conversation`
    as read (`LIFE_READ`), only those of its life, as every reader of the thread selects them
    (`thread_of`): a checkpoint a graph wrote after the thread's delete is of the earlier
    life, whose `seq`s are not this one's, whatever it names (that life's epoch, its creation
    time alone, or nothing). Without it, those of every life under the id."""
    held = {"from": {"$lte": seq}, "to": {"$gt": seq}}
    query = {"thread_id": conversation_id, "messages.segments": {"$elemMatch": held}}
    if conversation is None:
        return query
    return thread_of({**conversation, "_id": conversation_id}) | query


THREAD_COLLECTIONS: tuple[str, ...] = (LANGGRAPH_CHECKPOINTS,)
"""Collections integrations keep beside the conversations (their indexes are theirs): each
document names its conversation as `thread_id`, when it has one the user it was written for
as `user_id`, and which conversation under that id it was written for (`ThreadLife.marks`).
Deleting a conversation deletes its documents there (its owner's or no user's, of that
conversation or of none named), erasing a user deletes the documents of the user's
conversations (the user's or no user's) and every one naming the user, and a claim moves them
with the conversations, as it moves the messages."""
THREAD_EPOCH = "epoch"
"""The field naming the conversation a document beside it was written for: the conversation's
`epoch`, as its messages carry it (drawn at random as the conversation is created: no caller
chooses it, and no conversation started again under the id has it). Null when the conversation
had none yet (created before epochs, no turn since drew it)."""
THREAD_CONVERSATION = "conversation_created_ms"
"""The conversation's creation time in milliseconds (`conversation_mark`), which documents
beside it named it by before they named its epoch: a conversation created since never takes a
document naming no epoch for its own (`ThreadLife`). Still written beside the epoch, so that a
process of an earlier release reads what this one writes during a rolling upgrade."""


def conversation_mark(created_at: datetime) -> Int64:
    """A conversation's creation time as documents beside it stored it before they named its
    epoch: in whole milliseconds (what a BSON date keeps of it, read back or not)."""
    return Int64(epoch_millis(created_at))


@dataclass(frozen=True)
class ThreadLife:
    """Which conversation under an id the documents beside it (`THREAD_COLLECTIONS`) belong
    to: the one whose `epoch` they name. `created_at` is the caller's to choose (a turn's
    first message's), so it never tells one conversation from another started again under
    the id, except for documents stored before they named an epoch (`THREAD_CONVERSATION`
    only), and only for a conversation created before it named epochs on them
    (`Conversation.epoch_marks` false: theirs may be of it). A conversation created since
    (`epoch_only`) holds only documents naming its epoch."""

    epoch: str | None
    created_ms: int
    epoch_only: bool = False

    @classmethod
    def of(cls, conversation: Mapping[str, Any]) -> ThreadLife:
        """The life of a conversation as read (its document's `epoch`, `created_at` and
        `epoch_marks`, or a `Conversation` dumped by alias)."""
        epoch = conversation.get("epoch")
        marked = bool(conversation.get("epoch_marks")) and epoch is not None
        return cls(epoch, conversation_mark(conversation["created_at"]), marked)

    @classmethod
    def named_by(cls, document: Mapping[str, Any]) -> ThreadLife | None:
        """The life a document beside the conversations names; None when it names none."""
        epoch, created = document.get(THREAD_EPOCH), document.get(THREAD_CONVERSATION)
        if created is None:
            return None
        return cls(epoch, int(created))

    def marks(self) -> dict[str, Any]:
        """The fields naming this life on a document written for it."""
        return {THREAD_EPOCH: self.epoch, THREAD_CONVERSATION: Int64(self.created_ms)}

    def query(self) -> dict[str, Any]:
        """A filter for the documents of this life, or naming none (stored before documents
        named their conversation) when the conversation is older than epoch marks."""
        if self.epoch_only:
            return {THREAD_EPOCH: self.epoch}
        created = {"$in": [Int64(self.created_ms), None]}
        return {THREAD_EPOCH: {"$in": [self.epoch, None]}, THREAD_CONVERSATION: created}

    def holds(self, document: Mapping[str, Any]) -> bool:
        """Whether `document` is of this life, as `query` selects."""
        epoch = document.get(THREAD_EPOCH)
        if self.epoch_only:
            return epoch == self.epoch
        created = document.get(THREAD_CONVERSATION)
        return epoch in (None, self.epoch) and created in (None, self.created_ms)

    def same_as(self, other: ThreadLife) -> bool:
        """Whether `other` (a life a document names, or the conversation read again) is this
        one: the same epoch; else, one of them naming none, the same creation time, never for a
        conversation created since documents named epochs (all of its name its epoch)."""
        if self.epoch is not None and other.epoch is not None:
            return self.epoch == other.epoch
        if self.epoch_only or other.epoch_only:
            return False
        return self.created_ms == other.created_ms


LIFE_READ = {"epoch": 1, "created_at": 1, "epoch_marks": 1}
"""What `thread_of` reads of a conversation."""


def thread_of(found: Mapping[str, Any]) -> dict[str, Any]:
    """The documents beside the conversations (`THREAD_COLLECTIONS`) of the conversation
    `found` (its `_id`, read with `LIFE_READ`): those naming its epoch, or, of one created
    before documents named it, its creation time or nothing (`ThreadLife.query`). The one
    rule a delete, an erasure, a claim and a pop select a conversation's documents by."""
    query: dict[str, Any] = {"thread_id": found["_id"]}
    if found.get("created_at") is not None:
        query |= ThreadLife.of(found).query()
    return query


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
