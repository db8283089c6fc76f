"""Whole texts of cut messages in GridFS, through the synchronous driver (see
`agent_store.store._blobs` for the format): written before the messages that name
them, read back by `verify` and checked by `finish`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import bson
from pymongo.database import Database
from pymongo.errors import BulkWriteError

from agent_store.core import AgentMessage, message_adapter
from agent_store.store import (
    BLOB_CHUNKS,
    BLOB_FILES,
    MESSAGES,
    FullText,
    blob_documents,
    kept_blob_ids,
    only_duplicates,
    texts_of,
    with_texts,
)
from migrations.bounds import Bounds, bounded


def present(db: Database[dict[str, Any]], blob_ids: Iterable[str]) -> set[str]:
    """Which of the files exist (their `files` document, written after their chunks)."""
    wanted = sorted(set(blob_ids))
    if not wanted:
        return set()
    return {d["_id"] for d in db[BLOB_FILES].find({"_id": {"$in": wanted}}, {"_id": 1})}


def _insert(
    db: Database[dict[str, Any]], name: str, docs: list[dict[str, Any]], bounds: Bounds
) -> None:
    for run in bounded(docs, [len(bson.encode(d)) for d in docs], bounds):
        try:
            db[name].insert_many(run, ordered=False)
        except BulkWriteError as exc:
            only_duplicates(exc)  # same ids, same bytes: a file a killed run had started


def keep(db: Database[dict[str, Any]], full_texts: Sequence[FullText], bounds: Bounds) -> None:
    """Write the files: all their chunks, then the `files` documents that make them visible.

    The files are not visible yet (or no longer: `forget`): any chunk of theirs a killed run
    left behind goes first, so the file is made of these texts' chunks only."""
    if not full_texts:
        return
    db[BLOB_CHUNKS].delete_many({"files_id": {"$in": [f.blob_id for f in full_texts]}})
    built = [blob_documents(full) for full in full_texts]
    _insert(db, BLOB_CHUNKS, [c for _, chunks in built for c in chunks], bounds)
    _insert(db, BLOB_FILES, [files for files, _ in built], bounds)


def forget(db: Database[dict[str, Any]], blob_ids: Sequence[str]) -> None:
    """Delete files: their `files` documents first (so none is seen half gone), then chunks."""
    if blob_ids:
        db[BLOB_FILES].delete_many({"_id": {"$in": list(blob_ids)}})
        db[BLOB_CHUNKS].delete_many({"files_id": {"$in": list(blob_ids)}})


def texts(db: Database[dict[str, Any]], blob_ids: Iterable[str]) -> dict[str, str]:
    """The whole texts found, by blob id; a missing or incomplete file is left out."""
    wanted = sorted(set(blob_ids))
    if not wanted:
        return {}
    files = db[BLOB_FILES].find({"_id": {"$in": wanted}})
    return texts_of(files, db[BLOB_CHUNKS].find({"files_id": {"$in": wanted}}))


def restore(db: Database[dict[str, Any]], messages: Sequence[AgentMessage]) -> list[AgentMessage]:
    """The messages with each cut field put back whole from its file, where it is found."""
    found = texts(db, (b for m in messages for b in kept_blob_ids(m).values()))
    return [with_texts(m, found) for m in messages]


def stored_messages(db: Database[dict[str, Any]], ids: list[str]) -> dict[str, list[AgentMessage]]:
    """Every stored message of these conversations by `seq`, cut fields put back whole: one
    read of the messages and one restore for them all."""
    query = {"conversation_id": {"$in": ids}}
    docs = db[MESSAGES].find(query).sort([("conversation_id", 1), ("seq", 1)])
    stored: dict[str, list[AgentMessage]] = {i: [] for i in ids}
    for message in restore(db, [message_adapter.validate_python(d) for d in docs]):
        stored[str(message.conversation_id)].append(message)
    return stored
